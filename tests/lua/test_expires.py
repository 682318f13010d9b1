"""An x-expires queue expires as a whole once unused past its TTL, never job by job."""

from __future__ import annotations

import time

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome

TTL_MS = 200


def queue_keys(client: redis.Redis, store: JobStore, queue: str) -> list[bytes]:
    return sorted(client.scan_iter(match=store.keys(queue).base + "*", count=1000))


def test_a_job_waiting_longer_than_the_ttl_of_a_queue_in_use_is_kept(
    store: JobStore, client: redis.Redis
) -> None:
    store.declare_expiring("tmp", TTL_MS)
    # The old job waits behind higher-priority traffic that keeps the queue in use.
    assert store.enqueue("tmp", "old", b'{"id":"old"}', priority=9, ttl_ms=TTL_MS) is Outcome.OK
    started = time.monotonic()
    n = 0
    while time.monotonic() - started < 3 * TTL_MS / 1000:
        store.enqueue("tmp", f"n{n}", b"{}", priority=0, ttl_ms=TTL_MS)
        [job] = store.claim("tmp", "w", ttl_ms=TTL_MS)
        assert job.id == f"n{n}"
        assert store.ack("tmp", job.id, job.token) is Outcome.OK
        assert store.expire() == {}
        n += 1
        time.sleep(TTL_MS / 4000)
    k = store.keys("tmp")
    assert client.zrange(k.pending, 0, -1) == [b"old"]
    assert client.pttl(k.job("old")) == -1
    assert store.job("tmp", "old")["payload"] == '{"id":"old"}'
    [job] = store.claim("tmp", "w", ttl_ms=TTL_MS)
    assert (job.id, job.payload) == ("old", b'{"id":"old"}')
    assert client.smembers(store.expiring_key) == {b"tmp"}


def test_an_unused_queue_is_purged_and_leaves_no_key(store: JobStore, client: redis.Redis) -> None:
    store.declare_expiring("tmp", TTL_MS)
    for i in ("a", "b"):
        store.enqueue("tmp", i, b"{}", ttl_ms=TTL_MS)
    store.enqueue("tmp", "g", b"{}", ttl_ms=TTL_MS, group="t")
    # Still in use: nothing goes.
    assert store.expire() == {}
    assert store.counts("tmp")["pending"] == 3
    time.sleep(TTL_MS * 1.5 / 1000)
    assert not client.exists(store.keys("tmp").expires)
    assert store.expire() == {"tmp": 3}
    assert queue_keys(client, store, "tmp") == []
    assert client.smembers(store.expiring_key) == set()
    assert store.expire() == {}


def test_an_expired_queue_keeps_its_leased_jobs_until_they_are_acked(
    store: JobStore, client: redis.Redis
) -> None:
    store.declare_expiring("tmp", TTL_MS)
    for i in ("leased", "waiting1", "waiting2"):
        store.enqueue("tmp", i, b"{}", ttl_ms=TTL_MS)
    [job] = store.claim("tmp", "w", ttl_ms=TTL_MS, now_ms=store.server_ms())
    assert job.id == "leased"
    time.sleep(TTL_MS * 1.5 / 1000)
    assert store.expire() == {"tmp": 2}
    k = store.keys("tmp")
    assert not client.exists(k.job("waiting1"), k.job("waiting2"), k.pending, k.wake)
    assert store.job("tmp", "leased")["state"] == "active"
    # The leased job is still there: the queue stays registered for expiry.
    assert client.smembers(store.expiring_key) == {b"tmp"}
    assert store.ack("tmp", "leased", job.token) is Outcome.OK
    assert store.metrics("tmp")["completed"] == 1
    assert 0 < client.pttl(k.metrics("completed")) <= 30 * 86_400_000
    assert store.expire() == {}
    assert client.smembers(store.expiring_key) == set()
    # Gone, with nothing left in it: its counters go too.
    assert queue_keys(client, store, "tmp") == []


def test_a_queue_used_again_before_the_expiry_pass_is_kept(
    store: JobStore, client: redis.Redis
) -> None:
    store.declare_expiring("tmp", TTL_MS)
    store.enqueue("tmp", "a", b"{}", ttl_ms=TTL_MS)
    time.sleep(TTL_MS * 1.5 / 1000)
    # A publish after the TTL is a use: the queue lives on, its older job with it.
    store.enqueue("tmp", "b", b"{}", ttl_ms=TTL_MS)
    assert store.expire() == {}
    assert client.zrange(store.keys("tmp").pending, 0, -1) == [b"a", b"b"]


def test_an_expired_queue_leaves_no_counter_of_fenced_settles(
    store: JobStore, client: redis.Redis
) -> None:
    store.declare_expiring("tmp", TTL_MS)
    store.enqueue("tmp", "j", b"{}", ttl_ms=TTL_MS)
    [job] = store.claim("tmp", "w", ttl_ms=TTL_MS)
    # An ack naming a claim other than the live one is counted as fenced.
    store.ack("tmp", "j", "1.not-the-live-claim")
    assert client.exists(store.keys("tmp").metrics("fenced"))
    assert store.ack("tmp", "j", job.token) is Outcome.OK
    time.sleep(TTL_MS * 1.5 / 1000)
    assert store.expire() == {}
    assert client.smembers(store.expiring_key) == set()
    assert queue_keys(client, store, "tmp") == []
