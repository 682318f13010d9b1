"""Every key of a queue has an owner and an end: counters expire, drained queues drop their keys."""

from __future__ import annotations

import time

import redis

from celery_emq import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.sweeper import Sweeper

COUNTER_TTL_MS = 30 * 86_400_000


def keys_without_ttl(client: redis.Redis, store: JobStore) -> list[str]:
    found = sorted(client.scan_iter(match=store.prefix + "*", count=1000))
    return [k.decode()[len(store.prefix) :] for k in found if client.pttl(k) == -1]


def test_every_counter_ends_30_days_after_its_last_change(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    for i in ("a", "b", "c", "d"):
        store.enqueue("q", i, b"{}", now_ms=1)
    a, b, _ = store.claim("q", "w", count=3, now_ms=2)
    store.ack("q", "a", a.token)
    store.start("q", "b", b.token)
    store.sweep("q", max_stalled=0, now_ms=2 + store.lease_ms + 1)  # b dies, c is requeued
    store.retry("q", ["b"])
    [d] = store.claim("q", "w", now_ms=3)
    store.bury("q", d.id, d.token, "rejected", "no")
    for name in ("completed", "stalled", "failed", "retried"):
        ttl = client.pttl(k.metrics(name))
        assert COUNTER_TTL_MS - 60_000 < ttl <= COUNTER_TTL_MS, name


def test_a_sweep_drops_the_ordering_keys_of_a_queue_with_nothing_pending(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.enqueue("q", "b", b"{}", now_ms=1)
    [_, b] = store.claim("q", "w", count=2, now_ms=2)
    store.release("q", "b", b.token)  # head
    # b leaves pending by an ack (its task completed after all), not a claim: head stays.
    store.ack("q", "b", b.token)
    assert client.exists(k.head) == 1 and client.zcard(k.pending) == 0
    store.sweep("q", max_stalled=1, now_ms=3)
    assert client.exists(k.seq, k.head, k.wake, k.cursor) == 0
    # a is still leased: its keys stay, and the queue goes on as before.
    assert client.zscore(k.active, "a") is not None
    store.enqueue("q", "c", b"{}", now_ms=4)
    assert [j.id for j in store.claim("q", "w", now_ms=5)] == ["c"]


def test_a_gone_task_queue_leaves_the_registry_once_its_counters_end(
    store: JobStore, client: redis.Redis
) -> None:
    sweeper = Sweeper(store, EmqOptions(dead_max_age_s=0))
    tokens = {}
    for q in ("gone", "dead-kept"):
        store.register(q)
        store.enqueue(q, "j", b"{}")
        [job] = store.claim(q, "w")
        tokens[q] = job.token
    store.ack("gone", "j", tokens["gone"])
    store.bury("dead-kept", "j", tokens["dead-kept"], "rejected", "no")
    sweeper.run()
    assert store.queues() == ["dead-kept", "gone"]
    # 30 days on, the counters have ended: only the queue holding a dead job stays.
    for q in ("gone", "dead-kept"):
        for name in ("completed", "failed"):
            client.pexpire(store.keys(q).metrics(name), 1)
    client.pexpire(store.keys("gone").base + "swept", 1)
    client.pexpire(store.keys("dead-kept").base + "swept", 1)
    time.sleep(0.01)
    sweeper.run()
    assert store.queues() == ["dead-kept"]
    assert [k for k in keys_without_ttl(client, store) if "gone" in k] == []
