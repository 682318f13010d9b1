from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from tests.conftest import token_of


def claim_all(store: JobStore, queue: str, per_call: int = 1) -> list[str]:
    got: list[str] = []
    while True:
        jobs = store.claim(queue, "w", count=per_call, now_ms=1000)
        if not jobs:
            return got
        got += [j.id for j in jobs]


def test_grouped_job_waits_in_its_lane(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a1", b"{}", group="tenant-a", now_ms=1)
    k = store.keys("q")
    assert client.zrange(k.lane("tenant-a"), 0, -1) == [b"a1"]
    assert client.zcard(k.pending) == 0
    assert client.zrange(k.lanes, 0, -1) == [b"tenant-a"]
    assert store.job("q", "a1")["group"] == "tenant-a"
    assert store.counts("q")["pending"] == 1
    assert store.lanes("q") == {"tenant-a": 1}


def test_claims_rotate_so_a_flood_cannot_starve_others(store: JobStore) -> None:
    for i in range(50):
        store.enqueue("q", f"a{i}", b"{}", group="a", now_ms=1)
    for i in range(3):
        store.enqueue("q", f"b{i}", b"{}", group="b", now_ms=1)
    for i in range(2):
        store.enqueue("q", f"u{i}", b"{}", now_ms=1)
    got = claim_all(store, "q", per_call=4)
    assert got[:8] == ["a0", "b0", "u0", "a1", "b1", "u1", "a2", "b2"]
    assert got[8:] == [f"a{i}" for i in range(3, 50)]


def test_rotation_continues_across_claims(store: JobStore) -> None:
    for g in ("a", "b", "c"):
        for i in range(2):
            store.enqueue("q", f"{g}{i}", b"{}", group=g, now_ms=1)
    got = claim_all(store, "q", per_call=1)
    assert got == ["a0", "b0", "c0", "a1", "b1", "c1"]


def test_priority_orders_within_a_lane(store: JobStore) -> None:
    store.enqueue("q", "low", b"{}", group="a", priority=9, now_ms=1)
    store.enqueue("q", "high", b"{}", group="a", priority=0, now_ms=1)
    assert claim_all(store, "q") == ["high", "low"]


def test_recovery_and_release_return_to_the_lane_front(
    store: JobStore, client: redis.Redis
) -> None:
    for i in range(3):
        store.enqueue("q", f"a{i}", b"{}", group="a", now_ms=1)
    store.claim("q", "w", count=2, now_ms=1000)  # a0, a1
    assert store.start("q", "a0", token_of(store, "q", "a0")).name == "OK"
    k = store.keys("q")
    [swept] = store.sweep("q", max_stalled=1, limit=1, now_ms=1000 + store.lease_ms + 1)
    assert swept.id == "a0" and swept.outcome == "recovered"
    assert store.release("q", "a1", token_of(store, "q", "a1")).name == "OK"
    assert client.zrange(k.lane("a"), 0, -1) == [b"a1", b"a0", b"a2"]
    assert client.zcard(k.pending) == 0


def test_reap_returns_to_the_lane(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a0", b"{}", group="a", now_ms=1)
    store.claim("q", "w", now_ms=1000)
    assert store.reap("q", now_ms=1000 + store.lease_ms + 1) == ["a0"]
    k = store.keys("q")
    assert client.zrange(k.lane("a"), 0, -1) == [b"a0"]
    assert client.zrange(k.lanes, 0, -1) == [b"a"]


def test_drained_lanes_leave_no_keys(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a0", b"{}", group="a", now_ms=1)
    store.enqueue("q", "u0", b"{}", now_ms=1)
    assert sorted(claim_all(store, "q", per_call=5)) == ["a0", "u0"]
    k = store.keys("q")
    assert not client.exists(k.lanes, k.lane("a"), k.cursor, k.wake, k.seq, k.pending)


def test_purge_clears_lanes(store: JobStore, client: redis.Redis) -> None:
    for g in ("a", "b"):
        for i in range(3):
            store.enqueue("q", f"{g}{i}", b"{}", group=g, now_ms=1)
    store.enqueue("q", "u", b"{}", now_ms=1)
    assert store.purge("q") == 7
    k = store.keys("q")
    assert not client.exists(k.lanes, k.lane("a"), k.lane("b"), k.pending, k.job("a0"))


def test_ack_of_a_reaped_grouped_job_removes_it_from_its_lane(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a0", b"{}", group="a", now_ms=1)
    store.claim("q", "w", now_ms=1000)
    store.reap("q", now_ms=1000 + store.lease_ms + 1)
    assert store.ack("q", "a0", token_of(store, "q", "a0")).name == "LEASE_LOST"
    k = store.keys("q")
    assert client.zcard(k.lane("a")) == 0
    assert client.llen(k.wake) == 0
