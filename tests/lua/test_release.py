from __future__ import annotations

import redis

from celery_emq.scripts import Outcome
from celery_emq.store import JobStore


def test_release_returns_job_to_front_uncounted(store: JobStore, client: redis.Redis) -> None:
    for i in ("a", "b", "c"):
        store.enqueue("q", i, b"{}", now_ms=1)
    store.claim("q", "w", now_ms=2)
    assert store.release("q", "a", "w") is Outcome.OK
    k = store.keys("q")
    assert client.zrange(k.pending, 0, -1) == [b"a", b"b", b"c"]
    assert client.zcard(k.active) == 0
    row = store.job("q", "a")
    assert (row["state"], row["owner"], row["stalled"]) == ("pending", "", "0")
    assert client.llen(k.wake) == 3
    [again] = store.claim("q", "w", now_ms=3)
    assert (again.id, again.deliveries) == ("a", 2)


def test_release_keeps_priority_band(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "hi", b"{}", priority=0, now_ms=1)
    store.enqueue("q", "lo", b"{}", priority=9, now_ms=1)
    store.claim("q", "w", count=2, now_ms=2)
    store.release("q", "lo", "w")
    store.release("q", "hi", "w")
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"hi", b"lo"]


def test_release_by_another_owner_is_refused(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "w1", now_ms=2)
    assert store.release("q", "a", "w2") is Outcome.LEASE_LOST
    assert client.zscore(store.keys("q").active, "a") is not None


def test_release_of_unclaimed_job_is_not_found(store: JobStore) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    assert store.release("q", "a", "w") is Outcome.NOT_FOUND
