"""Lapses before a start: counted (``lapsed``), bounded (``never_started``), claimed alone."""

from __future__ import annotations

import json

import redis

from celery_emq.store.jobstore import JobStore
from tests.conftest import bulk_start

T0 = 1000


def enqueue(store: JobStore, queue: str, ids: list[str], group: str = "") -> None:
    for n, i in enumerate(ids):
        store.enqueue(queue, i, json.dumps({"id": i}), now_ms=n + 1, group=group)


def lapse_unstarted(store: JobStore, queue: str, now_ms: int, alone: bool = True) -> list[str]:
    """Claim (alone) at ``now_ms`` without starting; return the ids claimed."""
    return [c.id for c in store.claim(queue, "w1", count=10, now_ms=now_ms, alone=alone)]


def test_lapses_before_a_start_are_counted_and_dead_letter_past_max_lapsed(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue(store, "q", ["p"])
    k = store.keys("q")
    outcomes = []
    now = T0
    for _ in range(3):
        assert lapse_unstarted(store, "q", now) == ["p"]
        now += store.lease_ms + 1
        client.hset(k.base + "swept", "at", now - 1)  # sweeps ran: no outage
        [swept] = store.sweep("q", max_stalled=1, now_ms=now, max_lapsed=2)
        outcomes.append((swept.outcome, swept.stalled, store.job("q", "p").get("lapsed")))
    assert outcomes == [("requeued", 0, "1"), ("requeued", 0, "2"), ("never_started", 0, "3")]
    assert swept.payload == b'{"id": "p"}'
    row = store.job("q", "p")
    assert (row["state"], row["stalled"], row["reason"], row["last_error"], row["owner"]) == (
        "dead",
        "0",
        "never_started",
        "never_started",
        "",
    )
    assert row["error"] == "never_started: lapsed 3 times before its task started, max_lapsed=2"
    assert int(row["died_ms"]) == now
    assert client.zrange(k.dead, 0, -1, withscores=True) == [(b"p", float(now))]
    assert client.zcard(k.pending) == client.zcard(k.active) == 0
    assert store.metrics("q") == {
        "completed": 0,
        "recovered": 0,
        "stalled": 0,
        "failed": 1,
        "retried": 0,
    }
    assert client.hget(k.base + "metrics:failed", "reason:never_started") == b"1"


def test_no_max_lapsed_never_dead_letters_a_job_that_never_starts(store: JobStore) -> None:
    enqueue(store, "q", ["p"])
    now = T0
    for n in range(1, 6):
        assert lapse_unstarted(store, "q", now) == ["p"]
        now += store.lease_ms + 1
        store.client.hset(store.keys("q").base + "swept", "at", now - 1)
        [swept] = store.sweep("q", max_stalled=0, now_ms=now, max_lapsed=None)
        assert (swept.outcome, store.job("q", "p")["lapsed"]) == ("requeued", str(n))


def test_a_started_lapse_is_a_stall_and_not_a_lapse(store: JobStore) -> None:
    enqueue(store, "q", ["a"])
    [c] = store.claim("q", "w1", now_ms=T0)
    bulk_start(store, "q", [(c.id, c.token)])
    [swept] = store.sweep("q", max_stalled=1, now_ms=T0 + store.lease_ms + 1, max_lapsed=0)
    assert (swept.outcome, swept.stalled) == ("recovered", 1)
    assert "lapsed" not in store.job("q", "a")


def test_reap_counts_lapses_before_a_start_and_dead_letters_nothing(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue(store, "q", ["a", "b"])
    claimed = store.claim("q", "w1", count=2, now_ms=T0)
    bulk_start(store, "q", [(c.id, c.token) for c in claimed if c.id == "a"])
    assert store.reap("q", now_ms=T0 + store.lease_ms + 1) == ["a", "b"]
    assert "lapsed" not in store.job("q", "a")
    assert store.job("q", "b")["lapsed"] == "1"
    assert client.zcard(store.keys("q").dead) == 0


def suspect(store: JobStore, queue: str, job_id: str) -> None:
    store.client.hset(store.keys(queue).job(job_id), "lapsed", 1)


def test_a_suspect_stops_a_batch_and_keeps_its_place_and_those_after_it(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue(store, "q", ["a", "p", "c", "d"])
    suspect(store, "q", "p")
    k = store.keys("q")
    before = client.zrange(k.pending, 0, -1, withscores=True)
    # Holding nothing does not let it in behind another job of the batch.
    assert lapse_unstarted(store, "q", T0, alone=True) == ["a"]
    assert client.zrange(k.pending, 0, -1, withscores=True) == before[1:]
    # First in line, it waits for a caller that holds nothing...
    assert lapse_unstarted(store, "q", T0, alone=False) == []
    assert client.zrange(k.pending, 0, -1, withscores=True) == before[1:]
    # ... which takes it alone, however many it asked for.
    assert lapse_unstarted(store, "q", T0, alone=True) == ["p"]
    assert lapse_unstarted(store, "q", T0, alone=False) == ["c", "d"]
    assert client.zrange(k.active, 0, -1) == [b"a", b"c", b"d", b"p"]


def test_a_claim_says_when_a_suspect_it_could_not_take_stopped_it(store: JobStore) -> None:
    enqueue(store, "q", ["a", "p", "c"])
    suspect(store, "q", "p")

    def claim(alone: bool) -> tuple[list[str], bool]:
        got = store.claim("q", "w1", count=10, now_ms=T0, alone=alone)
        return [c.id for c in got], got.suspect_waits

    # Stopped behind another job of the batch, or first in line but not alone.
    assert claim(alone=True) == (["a"], True)
    assert claim(alone=False) == ([], True)
    # Taken: nothing was left waiting for it.
    assert claim(alone=True) == (["p"], False)
    assert claim(alone=False) == (["c"], False)
    # An empty queue stops nothing.
    assert claim(alone=False) == ([], False)


def test_a_suspect_put_back_in_a_lane_keeps_its_lanes_turn(
    store: JobStore, client: redis.Redis
) -> None:
    # A claim stopped by a suspect it could not take leaves the rotation where
    # it was: the claim that may take it (alone, next) comes to its lane first,
    # not to the lane after it, again and again while other lanes have jobs.
    enqueue(store, "q", ["s"], group="a")
    enqueue(store, "q", ["b1", "b2"], group="b")
    suspect(store, "q", "s")
    client.set(store.keys("q").cursor, "b")  # lane b served last: lane a's turn

    def claim(alone: bool) -> list[str]:
        return [c.id for c in store.claim("q", "w1", count=1, now_ms=T0, alone=alone)]

    assert claim(alone=False) == []
    assert claim(alone=True) == ["s"]
    # Taken, it moved the rotation on: lane b is next.
    assert claim(alone=False) == ["b1"]


def test_a_suspect_in_a_lane_goes_back_to_its_lane(store: JobStore, client: redis.Redis) -> None:
    enqueue(store, "q", ["g1", "g2"], group="t1")
    suspect(store, "q", "g2")
    k = store.keys("q")
    lane = k.base + "g:t1:pending"
    score = client.zscore(lane, "g2")
    assert lapse_unstarted(store, "q", T0, alone=False) == ["g1"]
    assert client.zrange(lane, 0, -1, withscores=True) == [(b"g2", score)]
    assert client.zrange(k.lanes, 0, -1) == [b"t1"]
    assert lapse_unstarted(store, "q", T0, alone=False) == []
    assert lapse_unstarted(store, "q", T0, alone=True) == ["g2"]
    assert client.zcard(lane) == 0


def test_a_start_clears_the_count(store: JobStore) -> None:
    enqueue(store, "q", ["a"])
    assert lapse_unstarted(store, "q", T0) == ["a"]
    now = T0 + store.lease_ms + 1
    store.sweep("q", max_stalled=1, now_ms=now, max_lapsed=2)
    assert store.job("q", "a")["lapsed"] == "1"
    [c] = store.claim("q", "w1", now_ms=now)
    bulk_start(store, "q", [(c.id, c.token)])
    assert "lapsed" not in store.job("q", "a")


def test_a_job_retried_after_never_started_gets_a_fresh_budget_of_lapses(
    store: JobStore, client: redis.Redis
) -> None:
    # `dead retry` is the operator's verdict that the job deserves another go: it
    # starts again with no stalls and no lapses, as a job just published.
    enqueue(store, "q", ["p"])
    now = T0
    for _ in range(2):
        assert lapse_unstarted(store, "q", now) == ["p"]
        now += store.lease_ms + 1
        client.hset(store.keys("q").base + "swept", "at", now - 1)
        store.sweep("q", max_stalled=1, now_ms=now, max_lapsed=1)
    assert store.job("q", "p")["state"] == "dead"
    assert store.job("q", "p")["lapsed"] == "2"
    assert store.retry("q", ["p"], now_ms=now) == ["p"]
    row = store.job("q", "p")
    assert (row["state"], row["stalled"], row.get("lapsed", "0")) == ("pending", "0", "0")
    assert lapse_unstarted(store, "q", now) == ["p"]
    now += store.lease_ms + 1
    client.hset(store.keys("q").base + "swept", "at", now - 1)
    [swept] = store.sweep("q", max_stalled=1, now_ms=now, max_lapsed=1)
    # One innocent lapse is within the fresh budget: requeued, not back to the morgue.
    assert (swept.id, swept.outcome) == ("p", "requeued")
    assert store.job("q", "p")["lapsed"] == "1"


def test_the_claim_says_which_job_it_handed_out_as_a_suspect(store: JobStore) -> None:
    enqueue(store, "q", ["a", "p", "c"])
    suspect(store, "q", "p")

    def claim(alone: bool) -> list[tuple[str, bool]]:
        return [(c.id, c.suspect) for c in store.claim("q", "w1", count=10, now_ms=T0, alone=alone)]

    assert claim(alone=True) == [("a", False)]
    assert claim(alone=True) == [("p", True)]
    assert claim(alone=False) == [("c", False)]
