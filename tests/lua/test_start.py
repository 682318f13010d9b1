"""Only a claim whose task started is charged a stall when its lease lapses."""

from __future__ import annotations

import json

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.conftest import sweeps_ran_until

#: Four prefetched deliveries of one worker; only the poison's task started.
BATCH = ["j0", "j1", "poison", "x3"]


def crash(store: JobStore, claimed_ms: int, max_stalled: int) -> dict[str, tuple[str, int]]:
    """Claim the whole batch at ``claimed_ms``, start the poison, let every lease lapse.

    Returns each job's sweep outcome and stall count.
    """
    claimed = store.claim("q", "w1", count=len(BATCH), now_ms=claimed_ms)
    assert [j.id for j in claimed] == BATCH
    poison = next(j for j in claimed if j.id == "poison")
    assert store.start("q", "poison", poison.token) is Outcome.OK
    sweeps_ran_until(store, "q", claimed_ms + store.lease_ms)
    swept = store.sweep("q", max_stalled=max_stalled, now_ms=claimed_ms + store.lease_ms + 1)
    return {s.id: (s.outcome, s.stalled) for s in swept}


def enqueue_batch(store: JobStore) -> None:
    for i in [*BATCH, "later"]:
        store.enqueue("q", i, json.dumps({"id": i}), now_ms=1)


def test_a_dead_worker_charges_only_the_task_that_started(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue_batch(store)
    assert crash(store, 1000, max_stalled=1) == {
        "j0": ("requeued", 0),
        "j1": ("requeued", 0),
        "poison": ("recovered", 1),
        "x3": ("requeued", 0),
    }
    k = store.keys("q")
    # Back at the front, in the order they were claimed, ahead of the job behind them.
    assert client.zrange(k.pending, 0, -1) == [b"j0", b"j1", b"poison", b"x3", b"later"]
    assert client.llen(k.wake) == 5
    assert client.zcard(k.active) == client.zcard(k.dead) == 0
    for i in ("j0", "j1", "x3"):
        row = store.job("q", i)
        assert (row["state"], row["stalled"], row["owner"]) == ("pending", "0", "")
        assert "history" not in row
    row = store.job("q", "poison")
    assert (row["state"], row["stalled"]) == ("pending", "1")
    assert json.loads(row["history"]) == [
        {"at": 1000 + store.lease_ms + 1, "reason": "lease_expired", "owner": "w1", "stalled": 1}
    ]
    assert store.metrics("q") == {
        "completed": 0,
        "recovered": 1,
        "stalled": 1,
        "failed": 0,
        "retried": 0,
    }


def test_a_second_crash_dead_letters_the_poison_and_never_charges_the_innocent(
    store: JobStore, client: redis.Redis
) -> None:
    enqueue_batch(store)
    crash(store, 1000, max_stalled=1)
    # The innocents lapsed before they started: suspects now (see
    # test_never_started.py), each claimed and started, which clears the count.
    for i in ("j0", "j1"):
        [c] = store.claim("q", "w1", count=1, now_ms=20_000)
        assert c.id == i
        assert store.start("q", c.id, c.token) is Outcome.OK
        assert store.ack("q", c.id, c.token) is Outcome.OK
    # The poison started, so its lapse was a stall, not a lapse: it is no suspect.
    [poison] = store.claim("q", "w1", count=1, now_ms=50_000)
    assert poison.id == "poison"
    assert store.start("q", "poison", poison.token) is Outcome.OK
    sweeps_ran_until(store, "q", 50_000 + store.lease_ms)
    [swept] = store.sweep("q", max_stalled=1, now_ms=50_000 + store.lease_ms + 1)
    assert (swept.id, swept.outcome, swept.stalled) == ("poison", "dead", 2)
    k = store.keys("q")
    assert client.zrange(k.dead, 0, -1) == [b"poison"]
    assert client.zrange(k.pending, 0, -1) == [b"x3", b"later"]
    assert client.llen(k.wake) == 2
    row = store.job("q", "x3")
    assert (row["state"], row["stalled"], row["deliveries"], row["lapsed"]) == (
        "pending",
        "0",
        "1",
        "1",
    )
    assert "history" not in row
    row = store.job("q", "poison")
    assert (row["state"], row["stalled"], row["last_error"]) == ("dead", "2", "stalled")
    assert len(json.loads(row["history"])) == 2
    assert store.metrics("q") == {
        "completed": 2,
        "recovered": 1,
        "stalled": 2,
        "failed": 1,
        "retried": 0,
    }


def test_start_with_a_stale_token_is_fenced_and_writes_nothing(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "w1", now_ms=1000)
    store.reap("q", now_ms=1000 + store.lease_ms + 1)
    # Pending: no claim to start.
    assert store.start("q", "a", 1) is Outcome.NOT_FOUND
    [again] = store.claim("q", "w1", now_ms=20_000)
    assert again.deliveries == 2
    before = client.hgetall(store.keys("q").job("a"))
    assert store.start("q", "a", 1) is Outcome.FENCED
    assert client.hgetall(store.keys("q").job("a")) == before
    assert b"started" not in before
    # The stale start recorded nothing: the live claim's lapse is not a stall.
    [swept] = store.sweep("q", max_stalled=0, now_ms=20_000 + store.lease_ms + 1)
    assert (swept.outcome, swept.stalled) == ("requeued", 0)


def test_start_after_ack_does_not_resurrect_the_row(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [job] = store.claim("q", "w1", now_ms=1000)
    assert store.ack("q", "a", job.token) is Outcome.OK
    assert store.start("q", "a", job.token) is Outcome.NOT_FOUND
    k = store.keys("q")
    assert not client.exists(k.job("a"))
    # SCAN may return a key more than once (the keyspace can rehash meanwhile).
    assert set(client.scan_iter(match=k.base + "*")) == {k.metrics("completed").encode()}
