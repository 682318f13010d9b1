"""Lapses before a start: counted (``lapsed``), bounded (``never_started``), one suspect a call."""

from __future__ import annotations

import json

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.conftest import bulk_start

T0 = 1000


def enqueue(store: JobStore, queue: str, ids: list[str], group: str = "") -> None:
    for n, i in enumerate(ids):
        store.enqueue(queue, i, json.dumps({"id": i}), now_ms=n + 1, group=group)


def lapse_unstarted(
    store: JobStore, queue: str, now_ms: int, take_suspect: bool = True, owner: str = "w1"
) -> list[str]:
    """Claim at ``now_ms`` without starting; return the ids claimed."""
    got = store.claim(queue, owner, count=10, now_ms=now_ms, take_suspect=take_suspect)
    return [c.id for c in got]


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


def test_a_suspect_is_taken_beside_other_jobs_one_a_call(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue(store, "q", ["a", "p1", "c", "p2", "d"])
    suspect(store, "q", "p1")
    suspect(store, "q", "p2")
    k = store.keys("q")
    p2_score = client.zscore(k.pending, "p2")
    got = store.claim("q", "w1", count=10, now_ms=T0)
    # One suspect a call: the second keeps its place, the jobs behind it are taken.
    assert [(c.id, c.suspect) for c in got] == [
        ("a", False),
        ("p1", True),
        ("c", False),
        ("d", False),
    ]
    assert got.passed_suspect
    assert client.zrange(k.pending, 0, -1, withscores=True) == [(b"p2", p2_score)]
    # The suspect handed out is noted under its owner, with its claim id.
    [p1] = [c for c in got if c.id == "p1"]
    assert client.hget(k.base + "suspects", "w1") == f"p1 {p1.token} 1".encode()
    assert 0 < client.pttl(k.base + "suspects") <= 86_400_000


def test_a_caller_holding_a_suspect_takes_the_jobs_behind_the_next(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue(store, "q", ["p", "a", "b"])
    suspect(store, "q", "p")
    k = store.keys("q")
    score = client.zscore(k.pending, "p")
    got = store.claim("q", "w1", count=10, now_ms=T0, take_suspect=False)
    assert [c.id for c in got] == ["a", "b"]
    assert got.passed_suspect
    assert client.zrange(k.pending, 0, -1, withscores=True) == [(b"p", score)]
    # Nothing but the suspect left: nothing taken, and the marker popped goes back.
    client.delete(k.wake)  # the caller popped the last marker (held=1)
    got = store.claim("q", "w1", count=10, held=1, now_ms=T0, take_suspect=False)
    assert (list(got), got.passed_suspect) == ([], True)
    assert client.llen(k.wake) == 1
    # A caller that may take one takes it; an empty queue passes over nothing.
    assert lapse_unstarted(store, "q", T0, owner="w2") == ["p"]
    empty = store.claim("q", "w1", count=10, now_ms=T0, take_suspect=False)
    assert (list(empty), empty.passed_suspect) == ([], False)


def test_a_suspect_in_a_lane_holds_back_no_other_lane(store: JobStore, client: redis.Redis) -> None:
    enqueue(store, "q", ["s", "a2"], group="a")
    enqueue(store, "q", ["b1", "b2"], group="b")
    suspect(store, "q", "s")
    k = store.keys("q")
    lane = k.base + "g:a:pending"
    score = client.zscore(lane, "s")
    # Passed over in its lane, it keeps its place there; the rotation goes on.
    assert lapse_unstarted(store, "q", T0, take_suspect=False) == ["a2", "b1", "b2"]
    assert client.zrange(lane, 0, -1, withscores=True) == [(b"s", score)]
    assert client.zrange(k.lanes, 0, -1) == [b"a"]
    assert lapse_unstarted(store, "q", T0, take_suspect=False) == []
    assert lapse_unstarted(store, "q", T0) == ["s"]
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


def lapse_all(store: JobStore, queue: str, now_ms: int) -> dict[str, tuple[str, int, str]]:
    """Sweep past every lease (sweeps ran till then); each job's outcome, stalls, lapses."""
    store.client.hset(store.keys(queue).base + "swept", "at", now_ms - 1)
    swept = store.sweep(queue, max_stalled=1, now_ms=now_ms, max_lapsed=8)
    return {j.id: (j.outcome, j.stalled, store.job(queue, j.id).get("lapsed", "0")) for j in swept}


def test_an_owner_that_dies_holding_a_suspect_blames_it_alone(store: JobStore) -> None:
    # A prefork worker: its tasks run in children, which cannot kill it.
    enqueue(store, "q", ["p", "run", "wait"])
    suspect(store, "q", "p")
    claimed = {c.id: c for c in store.claim("q", "w1", count=10, now_ms=T0, runs_here=False)}
    assert claimed["p"].suspect
    # One neighbour started, one did not; the suspect never started: w1 died of it.
    bulk_start(store, "q", [("run", claimed["run"].token)])
    outcomes = lapse_all(store, "q", T0 + store.lease_ms + 1)
    assert outcomes == {
        "p": ("requeued", 0, "2"),
        "run": ("requeued", 0, "0"),
        "wait": ("requeued", 0, "0"),
    }
    assert store.metrics("q")["stalled"] == 0


def test_a_suspect_that_started_shields_no_neighbour(store: JobStore) -> None:
    enqueue(store, "q", ["p", "run", "wait"])
    suspect(store, "q", "p")
    claimed = {c.id: c for c in store.claim("q", "w1", count=10, now_ms=T0)}
    bulk_start(store, "q", [(i, claimed[i].token) for i in ("p", "run")])
    outcomes = lapse_all(store, "q", T0 + store.lease_ms + 1)
    assert outcomes == {
        "p": ("recovered", 1, "0"),
        "run": ("recovered", 1, "0"),
        "wait": ("requeued", 0, "1"),
    }


def test_another_owners_suspect_shields_no_one_else(store: JobStore) -> None:
    enqueue(store, "q", ["p", "a", "b"])
    suspect(store, "q", "p")
    assert [c.id for c in store.claim("q", "w1", count=1, now_ms=T0)] == ["p"]
    [a] = store.claim("q", "w2", count=1, now_ms=T0)
    assert [c.id for c in store.claim("q", "w2", count=1, now_ms=T0)] == ["b"]
    bulk_start(store, "q", [("a", a.token)])
    outcomes = lapse_all(store, "q", T0 + store.lease_ms + 1)
    assert outcomes == {
        "p": ("requeued", 0, "2"),
        "a": ("recovered", 1, "0"),
        "b": ("requeued", 0, "1"),
    }


def test_a_suspect_received_whole_shields_no_neighbour(store: JobStore) -> None:
    # Its consumer received it whole: it did not kill the worker as it was
    # received, so a later death is an ordinary crash. The task that started
    # beside it (a task that kills its own process, say) is charged its stall.
    enqueue(store, "q", ["p", "run"])
    suspect(store, "q", "p")
    claimed = {c.id: c for c in store.claim("q", "w1", count=10, now_ms=T0)}
    assert store.receive("q", "p", claimed["p"].token) is Outcome.OK
    assert "lapsed" not in store.job("q", "p")
    bulk_start(store, "q", [("run", claimed["run"].token)])
    outcomes = lapse_all(store, "q", T0 + store.lease_ms + 1)
    assert outcomes == {"p": ("requeued", 0, "1"), "run": ("recovered", 1, "0")}


def test_a_receive_of_a_stale_claim_is_fenced(store: JobStore) -> None:
    enqueue(store, "q", ["p"])
    suspect(store, "q", "p")
    [old] = store.claim("q", "w1", now_ms=T0)
    store.reap("q", now_ms=T0 + store.lease_ms + 1)
    [new] = store.claim("q", "w2", now_ms=T0 + store.lease_ms + 2)
    assert store.receive("q", "p", old.token) is Outcome.FENCED
    assert store.job("q", "p")["lapsed"] == "2"
    assert store.receive("q", "p", new.token) is Outcome.OK
    assert "started" not in store.job("q", "p")


def test_a_task_started_in_the_process_that_died_shares_the_blame(store: JobStore) -> None:
    # Threads, gevent, solo: the task that started there may have killed the
    # process after the suspect came; it is charged as usual, the suspect too.
    enqueue(store, "q", ["p", "run", "wait"])
    suspect(store, "q", "p")
    claimed = {c.id: c for c in store.claim("q", "w1", count=10, now_ms=T0, runs_here=True)}
    bulk_start(store, "q", [("run", claimed["run"].token)])
    outcomes = lapse_all(store, "q", T0 + store.lease_ms + 1)
    assert outcomes == {
        "p": ("requeued", 0, "2"),
        "run": ("recovered", 1, "0"),
        "wait": ("requeued", 0, "0"),
    }
