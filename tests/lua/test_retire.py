"""retire: a job the sweep doomed goes to the morgue, or is deleted as done, in one step."""

from __future__ import annotations

import json

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.conftest import bulk_start

T0 = 1000


def doom(store: JobStore, job_id: str, started: bool = True) -> int:
    """Enqueue, claim (and start) ``job_id``; sweep it past its budget (the script step
    only); return the sweep's time."""
    store.enqueue("q", job_id, json.dumps({"id": job_id}), now_ms=T0 - 1)
    [c] = store.claim("q", "w1@h:1:a", now_ms=T0)
    if started:
        bulk_start(store, "q", [(c.id, c.token)])
    now = T0 + store.lease_ms + 1
    k = store.keys("q")
    [swept] = store.scripts.sweep(k, now, 10, 0, "lease_expired", store.lease_ms, max_lapsed=0)
    assert (swept.id, swept.outcome) == (job_id, "doomed")
    return now


def metrics(client: redis.Redis, store: JobStore) -> dict[str, dict[bytes, bytes]]:
    k = store.keys("q")
    return {n: client.hgetall(k.metrics(n)) for n in ("completed", "failed", "stalled")}


def test_a_doomed_job_retired_as_failed_goes_to_the_morgue_counted_there(
    store: JobStore, client: redis.Redis
) -> None:
    now = doom(store, "a")
    k = store.keys("q")
    assert metrics(client, store) == {"completed": {}, "failed": {}, "stalled": {}}
    assert store.retire("q", "a", succeeded=False, now_ms=now + 5) is Outcome.OK
    row = store.job("q", "a")
    assert (row["state"], row["owner"], row["stalled"], row["reason"]) == (
        "dead",
        "",
        "1",
        "lease_expired",
    )
    assert (row["last_error"], row["died_ms"], "doomed" in row) == ("stalled", str(now + 5), False)
    assert row["error"] == "lease_expired: stalled 1 times, max_stalled=0"
    assert [h["owner"] for h in json.loads(row["history"])] == ["w1@h:1:a"]
    assert client.zrange(k.dead, 0, -1, withscores=True) == [(b"a", float(now + 5))]
    assert client.zcard(k.active) == 0
    assert metrics(client, store) == {
        "completed": {},
        "failed": {b"count": b"1", b"reason:lease_expired": b"1"},
        "stalled": {b"count": b"1", b"reason:lease_expired": b"1"},
    }
    # Retired once: a second call (another sweeper) finds nothing doomed.
    assert store.retire("q", "a", succeeded=False, now_ms=now + 6) is Outcome.NOT_FOUND
    assert client.hget(k.metrics("failed"), "count") == b"1"


def test_a_doomed_job_whose_task_succeeded_is_deleted_and_counted_completed(
    store: JobStore, client: redis.Redis
) -> None:
    now = doom(store, "a")
    k = store.keys("q")
    assert store.retire("q", "a", succeeded=True, now_ms=now) is Outcome.COMPLETED
    assert not client.exists(k.job("a"), k.msg("a"))
    assert client.zcard(k.active) == client.zcard(k.dead) == 0
    assert metrics(client, store) == {"completed": {b"count": b"1"}, "failed": {}, "stalled": {}}


def test_a_job_doomed_before_its_start_dies_never_started_and_counts_no_stall(
    store: JobStore, client: redis.Redis
) -> None:
    now = doom(store, "p", started=False)
    assert store.job("q", "p")["lapsed"] == "1"
    assert store.retire("q", "p", succeeded=False, now_ms=now) is Outcome.OK
    row = store.job("q", "p")
    assert (row["state"], row["reason"], row["stalled"]) == ("dead", "never_started", "0")
    assert metrics(client, store) == {
        "completed": {},
        "failed": {b"count": b"1", b"reason:never_started": b"1"},
        "stalled": {},
    }


def test_only_a_doomed_live_claim_is_retired(store: JobStore, client: redis.Redis) -> None:
    # A doomed job its late worker acked before the retire: done, nothing left to retire.
    now = doom(store, "a")
    token = store.job("q", "a")["claim"]
    assert store.ack("q", "a", token) is Outcome.OK
    assert store.retire("q", "a", succeeded=False, now_ms=now) is Outcome.NOT_FOUND
    assert client.zcard(store.keys("q").dead) == 0
    assert metrics(client, store) == {"completed": {b"count": b"1"}, "failed": {}, "stalled": {}}
    # A live claim the sweep never doomed, and no job at all.
    store.enqueue("q", "live", b"{}", now_ms=now)
    assert [c.id for c in store.claim("q", "w1", now_ms=now)] == ["live"]
    assert store.retire("q", "live", succeeded=False, now_ms=now) is Outcome.NOT_FOUND
    assert store.retire("q", "nothing", succeeded=True, now_ms=now) is Outcome.NOT_FOUND
    assert store.job("q", "live")["state"] == "active"
