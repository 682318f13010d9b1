from __future__ import annotations

import redis

from celery_emq.store import JobStore


def bury(store: JobStore, ids: list[str], died_ms: int) -> None:
    for i in ids:
        store.enqueue("q", i, b"{}", now_ms=1)
        store.bury("q", i, "rejected", "", now_ms=died_ms)


def test_trim_by_age_deletes_old_dead_jobs(store: JobStore, client: redis.Redis) -> None:
    bury(store, ["old1", "old2"], died_ms=1000)
    bury(store, ["new"], died_ms=9000)
    assert store.trim("q", max_age_ms=5000, max_size=0, now_ms=10_000) == 2
    k = store.keys("q")
    assert client.zrange(k.dead, 0, -1) == [b"new"]
    assert not client.exists(k.job("old1"), k.job("old2"))


def test_trim_by_size_keeps_the_newest(store: JobStore, client: redis.Redis) -> None:
    for n in range(5):
        bury(store, [f"d{n}"], died_ms=1000 + n)
    assert store.trim("q", max_age_ms=0, max_size=2, now_ms=2000) == 3
    assert client.zrange(store.keys("q").dead, 0, -1) == [b"d3", b"d4"]


def test_trim_in_batches(store: JobStore, client: redis.Redis) -> None:
    for n in range(25):
        bury(store, [f"d{n}"], died_ms=1000 + n)
    assert store.trim("q", max_age_ms=0, max_size=5, limit=7, now_ms=2000) == 20
    assert client.zcard(store.keys("q").dead) == 5


def test_trim_with_no_bounds_keeps_everything(store: JobStore, client: redis.Redis) -> None:
    bury(store, ["a", "b"], died_ms=1)
    assert store.trim("q", max_age_ms=0, max_size=0, now_ms=10**12) == 0
    assert client.zcard(store.keys("q").dead) == 2
