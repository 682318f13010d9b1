from __future__ import annotations

import redis

from celery_emq.store import JobStore
from tests.conftest import bulk_enqueue


def test_extend_moves_the_deadline_of_owned_leases(store: JobStore, client: redis.Redis) -> None:
    for i in ("a", "b"):
        store.enqueue("q", i, b"{}", now_ms=1)
    store.claim("q", "w", count=2, now_ms=1000)
    assert store.extend("q", "w", ["a", "b"], now_ms=4000) == []
    k = store.keys("q")
    assert client.zscore(k.active, "a") == 4000 + store.lease_ms
    assert client.zscore(k.active, "b") == 4000 + store.lease_ms


def test_extend_reports_lost_leases_and_leaves_them(store: JobStore, client: redis.Redis) -> None:
    for i in ("mine", "theirs", "gone"):
        store.enqueue("q", i, b"{}", now_ms=1)
    store.claim("q", "w", count=1, now_ms=1000)
    store.claim("q", "other", count=1, now_ms=1000)
    lost = store.extend("q", "w", ["mine", "theirs", "gone"], now_ms=2000)
    assert sorted(lost) == ["gone", "theirs"]
    k = store.keys("q")
    assert client.zscore(k.active, "theirs") == 1000 + store.lease_ms
    assert client.zscore(k.active, "gone") is None


def test_extend_more_ids_than_one_call_carries(store: JobStore, client: redis.Redis) -> None:
    n = 1300
    bulk_enqueue(store, "q", n)
    claimed = []
    while len(claimed) < n:
        claimed += [j.id for j in store.claim("q", "w", count=1000, now_ms=1)]
    assert store.extend("q", "w", claimed, now_ms=50_000) == []
    k = store.keys("q")
    assert client.zcount(k.active, 50_000 + store.lease_ms, 50_000 + store.lease_ms) == n
