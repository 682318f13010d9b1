"""The registry of task queues: what the sweep, the CLI and the morgue iterate."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Consumer, Exchange, Producer, Queue

from celery_emq import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.sweeper import Sweeper


@pytest.fixture
def conn(redis_url: str, prefix: str) -> Iterator[Connection]:
    c = Connection(
        redis_url.replace("redis://", "emq://", 1), transport_options={"global_keyprefix": prefix}
    )
    yield c
    c.release()


def test_a_reply_published_without_a_task_is_not_registered(
    conn: Connection, store: JobStore
) -> None:
    # What a remote-control or rpc:// reply looks like: a plain message, no task header.
    reply = Queue("abc.reply.celery.pidbox", Exchange("reply.celery.pidbox", "direct"), "abc")
    Producer(conn.channel()).publish(
        {"ok": "pong"},
        exchange=reply.exchange,
        routing_key="abc",
        declare=[reply],
        serializer="json",
    )
    assert store.counts("abc.reply.celery.pidbox")["pending"] == 1
    assert store.queues() == []


def test_a_celery_task_registers_its_queue(app: Celery, store: JobStore) -> None:
    app.send_task("proj.tasks.add", args=(1, 2))
    app.send_task("proj.tasks.add", args=(3, 4), queue="other")
    assert store.queues() == ["celery", "other"]
    assert store.counts("celery")["pending"] == 1


def test_consuming_with_acks_registers_and_without_does_not(
    conn: Connection, store: JobStore
) -> None:
    acked, unacked = (
        Queue("work", Exchange("work"), "work"),
        Queue("tail", Exchange("tail"), "tail"),
    )
    channel = conn.channel()
    with (
        Consumer(channel, [acked], callbacks=[lambda b, m: None], accept=["json"]),
        Consumer(channel, [unacked], callbacks=[lambda b, m: None], no_ack=True, accept=["json"]),
    ):
        try:
            conn.drain_events(timeout=0.1)
        except TimeoutError:
            pass
    assert store.queues() == ["work"]


def test_unregister_unused_drops_only_queues_without_any_key(
    store: JobStore, client: redis.Redis
) -> None:
    for q in ("empty", "used", "busy"):
        store.register(q)
    # "used" completed a job: only its counter is left.
    store.enqueue("used", "a", b"{}", now_ms=1)
    [job] = store.claim("used", "w", now_ms=2)
    store.ack("used", "a", job.token)
    assert sorted(client.scan_iter(match=store.keys("used").base + "*")) == [
        store.keys("used").metrics("completed").encode()
    ]
    store.enqueue("busy", "b", b"{}", now_ms=1)
    assert store.unregister_unused(["empty", "used", "busy"]) == ["empty"]
    assert store.queues() == ["busy", "used"]
    assert store.unregister_unused([]) == []


def test_a_beat_pass_prunes_the_registry_and_expires_unused_queues(
    store: JobStore, client: redis.Redis
) -> None:
    for q in ("stale-reply", "celery"):
        store.register(q)
    store.enqueue("celery", "a", b"{}", now_ms=1)
    store.declare_expiring("tmp", 100)
    store.enqueue("tmp", "t", b"{}", ttl_ms=100)
    time.sleep(0.2)
    reports: list[Any] = Sweeper(store, EmqOptions()).run()
    assert [r.queue for r in reports] == ["celery", "stale-reply"]
    assert store.queues() == ["celery"]
    assert store.counts("tmp")["pending"] == 0
    assert client.smembers(store.expiring_key) == set()
    # A pass over named queues leaves the registry alone.
    store.register("stale-reply")
    Sweeper(store, EmqOptions()).run(["celery"])
    assert store.queues() == ["celery", "stale-reply"]


def test_publishing_again_to_an_expired_queue_registers_it_again(
    conn: Connection, store: JobStore, client: redis.Redis
) -> None:
    ttl_ms = 300
    tmp = Queue("tmp", Exchange("tmp", "direct"), "tmp", expires=ttl_ms / 1000)
    producer = Producer(conn.channel())
    producer.publish({"n": 1}, exchange=tmp.exchange, routing_key="tmp", declare=[tmp])
    assert client.smembers(store.expiring_key) == {b"tmp"}
    time.sleep(2 * ttl_ms / 1000)
    # Unused for longer than its TTL: the pass purges it and lets it go.
    assert store.expire() == {"tmp": 1}
    assert client.smembers(store.expiring_key) == set()
    # The same channel publishes again (its declare is cached): the queue is in
    # use again and back in the registry, so its job expires in its turn.
    producer.publish({"n": 2}, exchange=tmp.exchange, routing_key="tmp", declare=[tmp])
    assert client.smembers(store.expiring_key) == {b"tmp"}
    assert store.counts("tmp")["pending"] == 1
    time.sleep(2 * ttl_ms / 1000)
    assert store.expire() == {"tmp": 1}
    assert store.counts("tmp") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
