from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.conftest import bulk_enqueue


def test_ack_deletes_row_and_lease(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [job] = store.claim("q", "w", now_ms=2)
    assert store.ack("q", "a", job.token) is Outcome.OK
    k = store.keys("q")
    assert client.zcard(k.active) == 0
    assert not client.exists(k.job("a"))
    assert store.metrics("q")["completed"] == 1


def test_ack_unknown_job_is_not_found(store: JobStore, client: redis.Redis) -> None:
    assert store.ack("q", "nope", 1) is Outcome.NOT_FOUND
    assert not client.exists(store.keys("q").metrics("completed"))


def test_ack_names_the_claim_not_the_owner(store: JobStore, client: redis.Redis) -> None:
    # Another process settling a claim it was handed (after a reconnect, say)
    # acks it: the token, not the owner string, identifies the claim.
    store.enqueue("q", "a", b"{}", now_ms=1)
    [job] = store.claim("q", "w2", now_ms=2)
    assert store.ack("q", "a", job.token) is Outcome.OK
    assert not client.exists(store.keys("q").job("a"))
    assert store.metrics("q")["completed"] == 1


def test_ack_of_a_recovered_job_reports_lease_lost_and_deletes(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [job] = store.claim("q", "w1", now_ms=2)
    assert store.reap("q", now_ms=2 + store.lease_ms + 1) == ["a"]
    k = store.keys("q")
    assert client.llen(k.wake) == 1
    assert store.ack("q", "a", job.token) is Outcome.LEASE_LOST
    assert not client.exists(k.job("a"))
    assert client.zcard(k.pending) == client.zcard(k.active) == 0
    assert client.llen(k.wake) == 0
    assert store.metrics("q")["completed"] == 1


def test_ack_of_a_dead_job_takes_it_out_of_the_morgue(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [job] = store.claim("q", "w", now_ms=2)
    store.bury("q", "a", job.token, "malformed", "bad json", now_ms=3)
    assert store.ack("q", "a", job.token) is Outcome.DEAD
    k = store.keys("q")
    assert client.zcard(k.dead) == 0
    assert not client.exists(k.job("a"))
    assert store.metrics("q") == {
        "completed": 1,
        "recovered": 0,
        "stalled": 0,
        "failed": 1,
        "retried": 0,
    }


def test_ack_many_reports_one_outcome_per_claim_across_calls(
    store: JobStore, client: redis.Redis
) -> None:
    n = 1200  # more than one ack call carries
    bulk_enqueue(store, "q", n)
    claimed = []
    while len(claimed) < n:
        claimed += [(j.id, j.token) for j in store.claim("q", "w", count=1000, now_ms=1)]
    outcomes = store.ack_many("q", [*claimed, ("missing", 1)])
    assert outcomes == [Outcome.OK] * n + [Outcome.NOT_FOUND]
    k = store.keys("q")
    assert client.zcard(k.active) == 0
    assert not client.exists(k.job("0"), k.job("1199"))
    assert store.metrics("q")["completed"] == n
    assert store.ack_many("q", []) == []
