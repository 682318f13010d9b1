from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome


def fill(store: JobStore, queue: str, ids: list[str], priority: int = 0) -> None:
    for i in ids:
        store.enqueue(queue, i, f'{{"id":"{i}"}}', priority=priority, now_ms=1)


def test_claim_moves_to_active_with_lease_deadline(store: JobStore, client: redis.Redis) -> None:
    fill(store, "q", ["a", "b"])
    [job] = store.claim("q", "w1", count=1, now_ms=10_000)
    assert job.id == "a"
    assert job.payload == b'{"id":"a"}'
    assert (job.stalled, job.deliveries) == (0, 1)
    k = store.keys("q")
    assert client.zscore(k.active, "a") == 10_000 + store.lease_ms
    assert client.zrange(k.pending, 0, -1) == [b"b"]
    row = store.job("q", "a")
    assert (row["state"], row["owner"], row["claimed_ms"]) == ("active", "w1", "10000")
    # One marker left per claimed job: one job remains, one marker remains.
    assert client.llen(k.wake) == 1


def test_claim_is_fifo_within_priority_and_lower_priority_first(store: JobStore) -> None:
    fill(store, "q", ["low1", "low2"], priority=9)
    fill(store, "q", ["mid1", "mid2"], priority=5)
    fill(store, "q", ["hi1"], priority=0)
    got = [j.id for j in store.claim("q", "w", count=10, now_ms=1)]
    assert got == ["hi1", "mid1", "mid2", "low1", "low2"]


def test_claim_batch_counts_markers_held(store: JobStore, client: redis.Redis) -> None:
    fill(store, "q", [str(i) for i in range(5)])
    k = store.keys("q")
    client.rpop(k.wake)  # what a consumer's BRPOP does
    got = store.claim("q", "w", count=3, held=1, now_ms=1)
    assert len(got) == 3
    assert client.llen(k.wake) == 2  # 5 markers - 1 popped - 2 more
    assert client.zcard(k.pending) == 2


def test_claim_empty_queue_returns_nothing_and_drains_keys(
    store: JobStore, client: redis.Redis
) -> None:
    fill(store, "q", ["a"])
    store.claim("q", "w", count=5, now_ms=1)
    k = store.keys("q")
    assert store.claim("q", "w", count=5, now_ms=2) == []
    assert not client.exists(k.wake, k.seq, k.head, k.pending)


def test_a_no_ack_batch_is_leased_at_claim_and_deleted_by_one_ack(
    store: JobStore, client: redis.Redis
) -> None:
    # A claim never deletes: a consumer that dies before the batch reaches its
    # callback leaves leased jobs to recover, and the handed-over batch is acked.
    fill(store, "q", ["a", "b"])
    got = store.claim("q", "w", count=2, now_ms=1)
    k = store.keys("q")
    assert client.zrange(k.active, 0, -1, withscores=True) == [
        (b"a", 1 + store.lease_ms),
        (b"b", 1 + store.lease_ms),
    ]
    assert store.ack_many("q", [(j.id, j.token) for j in got]) == [Outcome.OK, Outcome.OK]
    assert client.zcard(k.active) == 0
    assert not client.exists(k.job("a"), k.job("b"))
    assert store.metrics("q")["completed"] == 2


def test_claimed_job_is_never_in_two_sets_or_none(store: JobStore, client: redis.Redis) -> None:
    fill(store, "q", [str(i) for i in range(20)])
    store.claim("q", "w", count=7, now_ms=1)
    k = store.keys("q")
    pending = set(client.zrange(k.pending, 0, -1))
    active = set(client.zrange(k.active, 0, -1))
    assert not pending & active
    assert len(pending | active) == 20


def test_waiting_names_queues_with_pending_work(store: JobStore) -> None:
    fill(store, "busy", ["a"])
    store.enqueue("lanes-only", "b", b"{}", group="g", now_ms=1)
    fill(store, "drained", ["c"])
    store.claim("drained", "w", now_ms=1)
    assert store.waiting(["busy", "idle", "lanes-only", "drained"]) == ["busy", "lanes-only"]
    assert store.waiting([]) == []
