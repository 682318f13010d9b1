from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from tests.conftest import bulk_enqueue


def test_extend_moves_the_deadline_of_live_claims(store: JobStore, client: redis.Redis) -> None:
    for i in ("a", "b"):
        store.enqueue("q", i, b"{}", now_ms=1)
    got = store.claim("q", "w", count=2, now_ms=1000)
    assert [(j.id, j.deliveries) for j in got] == [("a", 1), ("b", 1)]
    claims = [(j.id, j.token) for j in got]
    assert store.extend("q", claims, now_ms=4000) == []
    k = store.keys("q")
    assert client.zscore(k.active, "a") == 4000 + store.lease_ms
    assert client.zscore(k.active, "b") == 4000 + store.lease_ms


def test_extend_reports_lost_claims_and_leaves_them(store: JobStore, client: redis.Redis) -> None:
    for i in ("mine", "reclaimed", "gone"):
        store.enqueue("q", i, b"{}", now_ms=1)
    first = {j.id: j.token for j in store.claim("q", "w", count=3, now_ms=1000)}
    # "reclaimed" lapsed and was claimed again (a new claim id); "gone" was acked.
    store.release("q", "reclaimed", first["reclaimed"])
    [again] = store.claim("q", "w", now_ms=1500)
    assert (again.id, again.deliveries) == ("reclaimed", 2)
    store.ack("q", "gone", first["gone"])
    lost = store.extend("q", sorted(first.items()), now_ms=2000)
    assert sorted(lost) == [("gone", first["gone"]), ("reclaimed", first["reclaimed"])]
    k = store.keys("q")
    assert client.zscore(k.active, "mine") == 2000 + store.lease_ms
    assert client.zscore(k.active, "reclaimed") == 1500 + store.lease_ms
    assert client.zscore(k.active, "gone") is None


def test_extend_more_claims_than_one_call_carries(store: JobStore, client: redis.Redis) -> None:
    n = 1300
    bulk_enqueue(store, "q", n)
    claimed = []
    while len(claimed) < n:
        claimed += [(j.id, j.token) for j in store.claim("q", "w", count=1000, now_ms=1)]
    assert store.extend("q", claimed, now_ms=50_000) == []
    k = store.keys("q")
    assert client.zcount(k.active, 50_000 + store.lease_ms, 50_000 + store.lease_ms) == n
    assert store.extend("q", []) == []
