"""The wake list holds one marker per claimable job, and recovered batches keep their order."""

from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.conftest import token_of

LEASE_MS = 5000


def claimable(store: JobStore, client: redis.Redis, queue: str = "q") -> int:
    """Assert LLEN(wake) equals the number of claimable jobs (lanes included); return it."""
    n = store.counts(queue)["pending"]
    assert client.llen(store.keys(queue).wake) == n
    return n


def test_every_transition_keeps_one_marker_per_claimable_job(
    client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", LEASE_MS)
    for i in range(6):
        store.enqueue("q", f"u{i}", b"{}", now_ms=1)
    for i in range(3):
        store.enqueue("q", f"g{i}", b"{}", group="t", now_ms=1)
    assert claimable(store, client) == 9

    # Claims rotate over lane "t" and the default lane.
    got = store.claim("q", "w", count=4, now_ms=1000)
    assert [j.id for j in got] == ["g0", "u0", "g1", "u1"]
    assert claimable(store, client) == 5

    # g0 and u0 lapse and are reaped; their stale acks delete them, one marker each.
    for j in got[2:]:
        store.extend("q", [(j.id, j.token)], now_ms=100_000)
    assert store.reap("q", now_ms=1000 + LEASE_MS + 1) == ["g0", "u0"]
    assert claimable(store, client) == 7
    assert store.ack("q", "u0", token_of(store, "q", "u0")) is Outcome.LEASE_LOST
    assert claimable(store, client) == 6
    assert store.ack("q", "g0", token_of(store, "q", "g0")) is Outcome.LEASE_LOST
    assert claimable(store, client) == 5

    # A pending job buried (its claim lapsed, the verdict is on the message).
    assert store.bury("q", "u2", 0, "rejected", "", now_ms=2000) is Outcome.OK
    assert store.bury("q", "g2", 0, "rejected", "", now_ms=2000) is Outcome.OK
    assert claimable(store, client) == 3

    assert store.release("q", "u1", token_of(store, "q", "u1")) is Outcome.OK
    assert claimable(store, client) == 4

    # g1 started and lapses: the sweep recovers it; a claim that never started is requeued.
    [u1] = store.claim("q", "w", now_ms=200_000)
    assert u1.id == "u1"
    assert claimable(store, client) == 3
    assert store.start("q", "g1", token_of(store, "q", "g1")) is Outcome.OK
    swept = store.sweep("q", max_stalled=5, now_ms=200_000 + LEASE_MS + 1)
    assert sorted((s.id, s.outcome) for s in swept) == [("g1", "recovered"), ("u1", "requeued")]
    assert claimable(store, client) == 5

    assert store.retry("q", ["u2", "g2"], now_ms=300_000) == ["u2", "g2"]
    assert claimable(store, client) == 7

    # A claim holding a marker popped by its BRPOP takes one fewer from the list.
    client.rpop(store.keys("q").wake)
    assert len(store.claim("q", "w", count=2, held=1, now_ms=400_000)) == 2
    assert claimable(store, client) == 5

    assert store.purge("q") == 5
    assert claimable(store, client) == 0
    assert not client.exists(store.keys("q").wake)


def test_a_drained_queue_drops_its_wake_list(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.enqueue("q", "b", b"{}", now_ms=1)
    store.claim("q", "w", count=2, now_ms=1000)
    assert not client.exists(store.keys("q").wake)
    assert store.claim("q", "w", now_ms=1001) == []
    assert not client.exists(store.keys("q").wake)


def enqueue_and_claim_one_by_one(store: JobStore, ids: list[str], from_ms: int) -> None:
    """Enqueue then claim ``ids`` one at a time, a millisecond apart, so each lapses in turn."""
    for n, i in enumerate(ids):
        store.enqueue("q", i, b"{}", now_ms=1)
        [job] = store.claim("q", "w", now_ms=from_ms + n)
        assert job.id == i
        store.start("q", i, job.token)


def test_a_reaped_batch_comes_back_in_its_order(store: JobStore, client: redis.Redis) -> None:
    # Ids sort against their order, so neither name nor arrival hides a reversal.
    enqueue_and_claim_one_by_one(store, ["c", "b", "a"], 1000)
    store.enqueue("q", "next", b"{}", now_ms=1)
    assert store.reap("q", now_ms=1002 + store.lease_ms + 1) == ["c", "b", "a"]
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"c", b"b", b"a", b"next"]
    got = store.claim("q", "w2", count=4, now_ms=50_000)
    assert [j.id for j in got] == ["c", "b", "a", "next"]


def test_a_swept_batch_comes_back_in_its_order(store: JobStore, client: redis.Redis) -> None:
    enqueue_and_claim_one_by_one(store, ["c", "b", "a"], 1000)
    store.enqueue("q", "next", b"{}", now_ms=1)
    swept = store.sweep("q", max_stalled=3, now_ms=1002 + store.lease_ms + 1)
    assert [(s.id, s.outcome) for s in swept] == [
        ("c", "recovered"),
        ("b", "recovered"),
        ("a", "recovered"),
    ]
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"c", b"b", b"a", b"next"]


def test_a_retried_batch_comes_back_in_the_order_given(
    store: JobStore, client: redis.Redis
) -> None:
    for i in ("a", "b", "c"):
        store.enqueue("q", i, b"{}", now_ms=1)
        store.bury("q", i, 0, "rejected", "", now_ms=10)
    store.enqueue("q", "next", b"{}", now_ms=1)
    assert store.retry("q", ["b", "c", "a"], now_ms=20) == ["b", "c", "a"]
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"b", b"c", b"a", b"next"]
    assert client.llen(store.keys("q").wake) == 4


def test_a_marker_given_back_after_another_consumer_claimed_is_dropped(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", now_ms=1)
    # Consumer 1 pops the only marker; consumer 2's scan claims the job first.
    assert client.rpop(k.wake) == b"1"
    [job] = store.claim("q", "c2", now_ms=2)
    assert job.id == "a"
    # Consumer 1 closes (or has no free slot) and gives its marker back: nothing
    # is claimable any more, so no marker is left over.
    assert store.give_back("q") is False
    assert client.llen(k.wake) == 0
    store.enqueue("q", "b", b"{}", now_ms=3)
    assert client.rpop(k.wake) == b"1"
    assert store.give_back("q") is True
    assert client.llen(k.wake) == 1


def test_a_lane_emptied_by_a_stale_ack_or_bury_leaves_no_trace(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    for job_id in ("a", "b"):
        store.enqueue("q", job_id, b"{}", group="g", now_ms=1)
        [claim] = store.claim("q", "w", now_ms=2)
        store.reap("q", now_ms=2 + store.lease_ms + 1)
        # The lapsed claim settles after all: the job leaves its lane.
        if job_id == "a":
            assert store.ack("q", "a", claim.token) is Outcome.LEASE_LOST
        else:
            assert store.bury("q", "b", claim.token, "rejected", now_ms=9) is Outcome.OK
        assert client.zrange(k.lanes, 0, -1) == []
        assert store.waiting(["q"]) == []
        # A consumer that had popped nothing hands no marker back for it either.
        assert store.give_back("q") is False
        assert client.llen(k.wake) == 0
