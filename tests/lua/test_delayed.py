"""Delayed jobs: a job with an ETA ahead waits in the broker until promoted."""

from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import NewJob, Outcome


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


def test_a_delayed_job_due_before_every_other_signals_the_consumers(
    store: JobStore, client: redis.Redis
) -> None:
    # Consumers wait until the earliest due time they know of: a job due
    # earlier must wake one of them (its own list, not the counted wake list).
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=5000, now_ms=1000)
    assert client.llen(k.soon) == 1
    assert client.llen(k.wake) == 0
    client.delete(k.soon)  # a consumer popped it
    store.enqueue("q", "b", b"{}", eta_ms=6000, now_ms=1000)
    assert client.llen(k.soon) == 0
    store.enqueue("q", "c", b"{}", eta_ms=4000, now_ms=1000)
    store.enqueue("q", "d", b"{}", eta_ms=3000, now_ms=1000)
    # One signal at most, however many earlier jobs come before a consumer pops it.
    assert client.llen(k.soon) == 1
    client.delete(k.soon)
    store.enqueue("q", "e", b"{}", now_ms=1000)
    assert client.llen(k.soon) == 0


def test_a_batch_with_a_job_due_before_every_other_signals_once(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=5000, now_ms=1000)
    client.delete(k.soon)
    store.enqueue_many("q", [NewJob("b", b"{}", eta_ms=7000), NewJob("c", b"{}")], now_ms=1000)
    assert client.llen(k.soon) == 0
    store.enqueue_many(
        "q", [NewJob("d", b"{}", eta_ms=4000), NewJob("e", b"{}", eta_ms=2000)], now_ms=1000
    )
    assert client.llen(k.soon) == 1


def test_scan_reports_when_the_next_delayed_job_is_due(store: JobStore) -> None:
    now = store.server_ms()
    store.enqueue("q1", "a", b"{}", eta_ms=now + 100_000)
    store.enqueue("q2", "b", b"{}", eta_ms=now + 20_000)
    store.enqueue("q2", "c", b"{}", eta_ms=now - 1)
    store.enqueue("q3", "d", b"{}")
    scan = store.scan(["q1", "q2", "q3"])
    assert scan.waiting == ["q2", "q3"]
    assert scan.next_due_ms is not None
    # On the server's clock, from the scan: at most the 20 s ahead, less the time taken.
    assert 19_000 < scan.next_due_ms <= 20_000
    assert store.scan(["q3"]).next_due_ms is None


def test_a_soon_marker_no_consumer_pops_has_an_end(store: JobStore, client: redis.Redis) -> None:
    # No consumer waits (none runs, or all are busy): the marker must not stay
    # for ever, and a purge that leaves nothing delayed takes it with it.
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=5000, now_ms=1000)
    assert 0 < client.pttl(k.soon) <= 60_000
    client.delete(k.soon)
    store.enqueue_many("q", [NewJob("b", b"{}", eta_ms=2000)], now_ms=1000)
    assert 0 < client.pttl(k.soon) <= 60_000
    store.purge("q")
    assert client.exists(k.soon) == 0


def test_delayed_jobs_sharing_a_task_id_are_each_revoked(
    store: JobStore, client: redis.Redis
) -> None:
    # A caller may give one task_id to two delayed publishes (or publish a batch
    # holding it twice): the revoke index keeps both, and a revoke reaches both.
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=10**13, task_id="t", now_ms=1000)
    assert store.enqueue_many("q", [NewJob("b", b"{}", 0, None, "", 10**13, "t")], now_ms=1000)
    store.enqueue("q", "c", b"{}", eta_ms=10**13, task_id="t", now_ms=1000)
    assert store.promote_tasks("q", ["t"]) == 3
    assert store.counts("q")["delayed"] == 0
    assert sorted((j.id, j.revoked) for j in store.claim("q", "w", count=3)) == [
        ("a", True),
        ("b", True),
        ("c", True),
    ]
    assert not client.exists(k.etas)


def test_a_promotion_by_eta_leaves_the_other_jobs_of_its_task_id_revocable(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=5000, task_id="t", now_ms=1000)
    store.enqueue("q", "b", b"{}", eta_ms=10**13, task_id="t", now_ms=1000)
    store.enqueue("q", "c", b"{}", eta_ms=10**13, task_id="t", now_ms=1000)
    assert store.promote("q", now_ms=5000) == 1
    assert store.promote_tasks("q", ["t"]) == 2
    assert store.counts("q") == {"pending": 3, "active": 0, "delayed": 0, "dead": 0}
    assert not client.exists(k.etas)
    # And by the sweep's promotion, and a purge of what is still delayed.
    store.enqueue("q", "d", b"{}", eta_ms=5000, task_id="u", now_ms=1000)
    store.enqueue("q", "e", b"{}", eta_ms=10**13, task_id="u", now_ms=1000)
    store.enqueue("q", "f", b"{}", eta_ms=10**13, task_id="v", now_ms=1000)
    store.sweep("q", 1, now_ms=6000)
    assert store.promote_tasks("q", ["u"]) == 1
    store.enqueue("q", "g", b"{}", eta_ms=10**13, task_id="v", now_ms=1000)
    assert store.purge("q") == 7  # a to e pending, f and g delayed
    assert not client.exists(k.etas)
