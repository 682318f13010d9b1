from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.conftest import token_of


def test_release_returns_job_to_front_uncounted(store: JobStore, client: redis.Redis) -> None:
    for i in ("a", "b", "c"):
        store.enqueue("q", i, b"{}", now_ms=1)
    [job] = store.claim("q", "w", now_ms=2)
    assert store.release("q", "a", job.token) is Outcome.OK
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
    assert store.release("q", "lo", token_of(store, "q", "lo")) is Outcome.OK
    assert store.release("q", "hi", token_of(store, "q", "hi")) is Outcome.OK
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"hi", b"lo"]


def test_release_with_a_stale_token_is_fenced(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [first] = store.claim("q", "w1", now_ms=2)
    store.reap("q", now_ms=2 + store.lease_ms + 1)
    [again] = store.claim("q", "w1", now_ms=10_000)
    assert again.deliveries == 2
    assert store.release("q", "a", first.token) is Outcome.FENCED
    k = store.keys("q")
    assert client.zscore(k.active, "a") == 10_000 + store.lease_ms
    assert store.job("q", "a")["state"] == "active"
    assert client.zcard(k.pending) == 0


def test_release_of_unclaimed_job_is_not_found(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    assert store.release("q", "a", 0) is Outcome.NOT_FOUND
    assert client.llen(store.keys("q").wake) == 1


def test_release_unless_started_leaves_a_started_claim(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.enqueue("q", "b", b"{}", now_ms=1)
    a, b = store.claim("q", "w", count=2, now_ms=2)
    assert store.start("q", "a", a.token) is Outcome.OK
    k = store.keys("q")
    before = (client.zrange(k.active, 0, -1, withscores=True), store.job("q", "a"))
    assert store.release("q", "a", a.token, unless_started=True) is Outcome.STARTED
    assert (client.zrange(k.active, 0, -1, withscores=True), store.job("q", "a")) == before
    # An unstarted claim goes back as usual; a plain release ignores the start.
    assert store.release("q", "b", b.token, unless_started=True) is Outcome.OK
    assert store.release("q", "a", a.token) is Outcome.OK
    assert client.zrange(k.pending, 0, -1) == [b"a", b"b"]
    assert client.llen(k.wake) == 2
