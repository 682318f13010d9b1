"""Delayed jobs: a job with an ETA ahead waits in the broker until promoted."""

from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome


def test_a_job_not_yet_due_waits_in_the_delayed_set(store: JobStore, client: redis.Redis) -> None:
    k = store.keys("q")
    assert store.enqueue("q", "a", b"{}", eta_ms=5000, task_id="t-a", now_ms=1000) is Outcome.OK
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 1, "dead": 0}
    assert client.llen(k.wake) == 0
    assert store.claim("q", "w", now_ms=4999) == []
    assert store.job("q", "a")["state"] == "delayed"
    assert client.hget(k.etas, "t-a") == b"a"
    # Not before its ETA.
    assert store.promote("q", now_ms=4999) == 0
    assert store.counts("q")["delayed"] == 1


def test_a_due_job_is_promoted_and_claimed_once(store: JobStore, client: redis.Redis) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b'{"a": 1}', eta_ms=5000, task_id="t-a", now_ms=1000)
    assert store.promote("q", now_ms=5000) == 1
    assert store.promote("q", now_ms=6000) == 0
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    assert client.llen(k.wake) == 1
    assert not client.hexists(k.etas, "t-a")
    [job] = store.claim("q", "w", now_ms=5001)
    assert (job.id, job.payload, job.revoked) == ("a", b'{"a": 1}', False)
    assert store.ack("q", "a", job.token) is Outcome.OK
    assert not client.exists(k.job("a"), k.msg("a"))


def test_promotion_goes_by_eta_behind_what_waits_and_keeps_lane_and_priority(
    store: JobStore,
) -> None:
    store.enqueue("q", "late", b"{}", eta_ms=3000, now_ms=1000)
    store.enqueue("q", "early", b"{}", eta_ms=2000, now_ms=1000)
    store.enqueue("q", "urgent", b"{}", priority=0, eta_ms=2500, now_ms=1000)
    store.enqueue("q", "low", b"{}", priority=5, eta_ms=1500, now_ms=1000)
    store.enqueue("q", "g", b"{}", group="g1", eta_ms=1500, now_ms=1000)
    store.enqueue("q", "now", b"{}", now_ms=1000)
    assert store.promote("q", now_ms=3000) == 5
    assert store.lanes("q") == {"g1": 1}
    claimed = [c.id for c in store.claim("q", "w", count=10, now_ms=3001)]
    # The default lane and the lane of g1 alternate; priority 0 before 5.
    assert [c for c in claimed if c != "g"] == ["now", "early", "urgent", "late", "low"]
    assert "g" in claimed


def test_an_eta_already_past_is_pending_at_once(store: JobStore) -> None:
    store.enqueue("q", "a", b"{}", eta_ms=999, task_id="t", now_ms=1000)
    assert store.counts("q")["pending"] == 1
    assert store.job("q", "a")["state"] == "pending"


def test_a_revoked_delayed_job_is_promoted_at_once_and_marked(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=10**13, task_id="t-a")
    store.enqueue("q", "b", b"{}", eta_ms=10**13, task_id="t-b")
    assert store.promote_tasks("q", ["t-a", "unknown"]) == 1
    assert store.promote_tasks("q", ["t-a"]) == 0
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 1, "dead": 0}
    [job] = store.claim("q", "w")
    assert (job.id, job.revoked) == ("a", True)
    assert client.hkeys(k.etas) == [b"t-b"]


def test_purge_deletes_delayed_jobs_too(store: JobStore, client: redis.Redis) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=10**13, task_id="t-a")
    store.enqueue("q", "b", b"{}")
    assert store.purge("q") == 2
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert not client.exists(k.etas, k.job("a"), k.msg("a"), k.job("b"), k.msg("b"))


def test_a_delayed_job_id_is_taken(store: JobStore) -> None:
    store.enqueue("q", "a", b"{}", eta_ms=10**13)
    assert store.enqueue("q", "a", b"{}") is Outcome.DUPLICATE
    assert store.counts("q")["pending"] == 0


def test_waiting_promotes_and_reports_claimable_queues(store: JobStore) -> None:
    now = store.server_ms()
    store.enqueue("q1", "a", b"{}", eta_ms=now + 100_000)
    store.enqueue("q2", "b", b"{}", eta_ms=now - 1)
    store.enqueue("q3", "c", b"{}")
    assert store.waiting(["q1", "q2", "q3"]) == ["q2", "q3"]
    store.client.zadd(store.keys("q1").delayed, {"a": now - 5})
    assert store.waiting(["q1"]) == ["q1"]
    assert store.counts("q1")["pending"] == 1
