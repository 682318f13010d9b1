"""Fencing: a settle names its claim (job id and token) and never touches a newer claim."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq.scripts import Outcome
from celery_emq.store import JobStore
from tests.conftest import ManualKeeper

LEASE_MS = 5000
#: The first claim lapses and is reaped; the second claim (token 2) is live from RECLAIMED_MS.
CLAIMED_MS = 1000
RECLAIMED_MS = 20_000


def snapshot(client: redis.Redis, prefix: str) -> dict[bytes, Any]:
    """Return every key under ``prefix`` with its full content.

    The head sequence is left out: a fenced charge may draw numbers from it,
    which only leaves a gap in the scores of later front-of-queue inserts.
    """
    out: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter(match=prefix + "*", count=1000)):
        if key.endswith(b":head"):
            continue
        kind = client.type(key)
        if kind == b"hash":
            out[key] = client.hgetall(key)
        elif kind == b"zset":
            out[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"list":
            out[key] = client.lrange(key, 0, -1)
        else:
            out[key] = client.get(key)
    return out


def reclaimed(store: JobStore) -> None:
    """Leave job "a" held by a live second claim (token 2) after its first claim lapsed.

    "b" waits behind it, so pending and the wake list are not empty.
    """
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    store.enqueue("q", "b", b'{"id":"b"}', now_ms=1)
    [first] = store.claim("q", "w1", now_ms=CLAIMED_MS)
    assert (first.id, first.deliveries) == ("a", 1)
    assert store.start("q", "a", 1) is Outcome.OK
    assert store.reap("q", now_ms=CLAIMED_MS + LEASE_MS + 1) == ["a"]
    [second] = store.claim("q", "w1", now_ms=RECLAIMED_MS)
    assert (second.id, second.deliveries) == ("a", 2)
    assert store.start("q", "a", 2) is Outcome.OK


STALE: dict[str, tuple[Callable[[JobStore], Any], Any]] = {
    "ack": (lambda s: s.ack("q", "a", 1), Outcome.FENCED),
    "ack_many": (lambda s: s.ack_many("q", [("a", 1)]), [Outcome.FENCED]),
    "release": (lambda s: s.release("q", "a", 1), Outcome.FENCED),
    "bury": (
        lambda s: s.bury("q", "a", 1, "rejected", "late", now_ms=RECLAIMED_MS + 1),
        Outcome.FENCED,
    ),
    "extend": (lambda s: s.extend("q", [("a", 1)], now_ms=RECLAIMED_MS + 1), [("a", 1)]),
    "charge": (lambda s: s.charge("q", "a", 1, 0, "worker_lost", now_ms=RECLAIMED_MS + 1), None),
}


@pytest.mark.parametrize("op", sorted(STALE))
def test_a_stale_settle_leaves_the_newer_claim_untouched(
    op: str, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", LEASE_MS)
    reclaimed(store)
    before = snapshot(client, prefix)
    call, expected = STALE[op]
    assert call(store) == expected
    if op.startswith("ack"):
        # The one mark a stale ack leaves: the job has completed once.
        before[store.keys("q").job("a").encode()][b"completed"] = b"1"
    assert snapshot(client, prefix) == before
    k = store.keys("q")
    row = store.job("q", "a")
    assert (row["state"], row["deliveries"], row["started"], row["stalled"]) == (
        "active",
        "2",
        "2",
        "0",
    )
    assert client.zrange(k.active, 0, -1, withscores=True) == [(b"a", RECLAIMED_MS + LEASE_MS)]
    assert client.zrange(k.pending, 0, -1) == [b"b"]
    assert client.llen(k.wake) == 1
    assert client.zcard(k.dead) == 0
    assert store.metrics("q") == {
        "completed": 0,
        "recovered": 0,
        "stalled": 0,
        "failed": 0,
        "retried": 0,
    }
    # The live claim still settles.
    assert store.ack("q", "a", 2) is Outcome.OK
    assert store.metrics("q")["completed"] == 1


def test_a_stale_ack_of_a_pending_job_deletes_it_and_one_marker(
    store: JobStore, client: redis.Redis
) -> None:
    for i in ("a", "b", "c"):
        store.enqueue("q", i, b"{}", now_ms=1)
    store.claim("q", "w1", now_ms=CLAIMED_MS)
    k = store.keys("q")
    assert client.llen(k.wake) == 2
    assert store.reap("q", now_ms=CLAIMED_MS + store.lease_ms + 1) == ["a"]
    assert client.llen(k.wake) == 3
    assert store.ack("q", "a", 1) is Outcome.LEASE_LOST
    assert not client.exists(k.job("a"))
    assert client.zrange(k.pending, 0, -1) == [b"b", b"c"]
    assert client.llen(k.wake) == 2
    assert client.zcard(k.active) == 0
    assert store.metrics("q")["completed"] == 1
    # The two markers left wake the two jobs left, and nothing is claimed twice.
    assert [j.id for j in store.claim("q", "w2", count=5, now_ms=30_000)] == ["b", "c"]
    assert not client.exists(k.wake)


def test_a_stale_ack_of_a_dead_job_takes_it_out_of_the_morgue(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "w1", now_ms=CLAIMED_MS)
    store.start("q", "a", 1)
    [swept] = store.sweep("q", max_stalled=0, now_ms=CLAIMED_MS + store.lease_ms + 1)
    assert swept.outcome == "dead"
    k = store.keys("q")
    assert client.zcard(k.dead) == 1
    # The task finished after all: a completed job is never left in the morgue.
    assert store.ack("q", "a", 1) is Outcome.DEAD
    assert client.zcard(k.dead) == 0
    assert not client.exists(k.job("a"))
    assert store.metrics("q") == {
        "completed": 1,
        "recovered": 0,
        "stalled": 1,
        "failed": 1,
        "retried": 0,
    }


def test_a_process_that_claims_a_job_again_after_losing_it_keeps_renewing_it(
    store: JobStore, client: redis.Redis
) -> None:
    keeper = ManualKeeper("w1")
    store.enqueue("q", "a", b"{}", now_ms=1)
    [first] = store.claim("q", keeper.owner, now_ms=CLAIMED_MS)
    [old_tag] = keeper.hold(store, "q", [(first.id, first.deliveries)], interval_ms=60_000)
    assert store.reap("q", now_ms=CLAIMED_MS + store.lease_ms + 1) == ["a"]
    assert keeper.renew_once(now_ms=CLAIMED_MS + store.lease_ms + 2) == [old_tag]
    assert keeper.is_lost(old_tag)
    # The same process claims the job again, under the same owner.
    [second] = store.claim("q", keeper.owner, now_ms=RECLAIMED_MS)
    [new_tag] = keeper.hold(store, "q", [(second.id, second.deliveries)], interval_ms=60_000)
    assert (old_tag, new_tag) == ("a#1", "a#2")
    assert not keeper.is_lost(new_tag)
    assert keeper.renew_once(now_ms=RECLAIMED_MS + 3000) == []
    k = store.keys("q")
    assert client.zscore(k.active, "a") == RECLAIMED_MS + 3000 + store.lease_ms
    # A hold of a tag found lost before starts renewing it again too.
    keeper.hold(store, "q", [("a", 2)], interval_ms=60_000)
    assert keeper.renew_once(now_ms=RECLAIMED_MS + 4000) == []
    assert client.zscore(k.active, "a") == RECLAIMED_MS + 4000 + store.lease_ms


LOSSES: dict[str, tuple[Callable[[JobStore], Any], Any]] = {
    "ack": (lambda s: s.ack("q", "a", 2), Outcome.OK),
    "release": (lambda s: s.release("q", "a", 2), Outcome.COMPLETED),
    "bury": (
        lambda s: s.bury("q", "a", 2, "rejected", "", now_ms=RECLAIMED_MS + 1),
        Outcome.COMPLETED,
    ),
    "charge": (
        lambda s: [x.outcome for x in [s.charge("q", "a", 2, 0, "worker_lost")] if x],
        ["completed"],
    ),
    "sweep": (
        lambda s: [(x.id, x.outcome) for x in s.sweep("q", 0, now_ms=RECLAIMED_MS + LEASE_MS + 1)],
        [("a", "completed")],
    ),
    "reap": (lambda s: s.reap("q", now_ms=RECLAIMED_MS + LEASE_MS + 1), []),
}


@pytest.mark.parametrize("op", sorted(LOSSES))
def test_a_job_an_older_claim_completed_is_never_run_again_nor_dead_lettered(
    op: str, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", LEASE_MS)
    reclaimed(store)
    # The first worker finishes after all: its ack is fenced, the job marked done.
    assert store.ack("q", "a", 1) is Outcome.FENCED
    call, expected = LOSSES[op]
    assert call(store) == expected
    # However the live claim ends (acked, released, dead-lettered, lapsed, charged
    # with a budget of 0), the job is gone and counted completed once.
    assert store.job("q", "a") == {}
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"b"]
    assert client.llen(store.keys("q").wake) == 1
    metrics = store.metrics("q")
    assert (metrics["completed"], metrics["failed"], metrics["recovered"]) == (1, 0, 0)
