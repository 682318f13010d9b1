"""Fencing: a settle names its claim (job id and claim id) and never touches another claim."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome, live_token
from tests.conftest import ManualKeeper, dump_keys, forget_writes, token_of

LEASE_MS = 5000
#: The first claim lapses and is reaped; the second claim is live from RECLAIMED_MS.
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


def reclaimed(store: JobStore) -> tuple[str, str]:
    """Leave job "a" held by a live second claim after its first claim lapsed.

    "b" waits behind it, so pending and the wake list are not empty. Returns the
    tokens of the first (stale) and the second (live) claim.
    """
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    store.enqueue("q", "b", b'{"id":"b"}', now_ms=1)
    [first] = store.claim("q", "w1", now_ms=CLAIMED_MS)
    assert (first.id, first.deliveries) == ("a", 1)
    assert store.start("q", "a", first.token) is Outcome.OK
    assert store.reap("q", now_ms=CLAIMED_MS + LEASE_MS + 1) == ["a"]
    [second] = store.claim("q", "w1", now_ms=RECLAIMED_MS)
    assert (second.id, second.deliveries) == ("a", 2)
    assert store.start("q", "a", second.token) is Outcome.OK
    return first.token, second.token


def reclaimed_after_lost_writes(
    store: JobStore, client: redis.Redis, prefix: str
) -> tuple[str, str]:
    """Leave job "a" held by a live claim the server made after it lost the claim before.

    The first claim (its task started) is lost with the server's last writes:
    the delivery count rolls back, and the next claim counts the same number
    again (1). Only the claim id tells the two apart. "b" waits behind.
    Returns the tokens of the lost (stale) and the live claim.
    """
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    store.enqueue("q", "b", b'{"id":"b"}', now_ms=1)
    before = dump_keys(client, prefix)
    [lost] = store.claim("q", "w1", now_ms=CLAIMED_MS)
    assert store.start("q", "a", lost.token) is Outcome.OK
    forget_writes(client, prefix, before)
    [live] = store.claim("q", "w1", now_ms=RECLAIMED_MS)
    assert (live.id, live.deliveries, lost.deliveries) == ("a", 1, 1)
    assert live.token != lost.token
    return lost.token, live.token


#: A settle of the stale claim, and what it answers.
STALE: dict[str, tuple[Callable[[JobStore, str], Any], Callable[[str], Any]]] = {
    "ack": (lambda s, t: s.ack("q", "a", t), lambda t: Outcome.FENCED),
    "ack_many": (lambda s, t: s.ack_many("q", [("a", t)]), lambda t: [Outcome.FENCED]),
    "release": (lambda s, t: s.release("q", "a", t), lambda t: Outcome.FENCED),
    "bury": (
        lambda s, t: s.bury("q", "a", t, "rejected", "late", now_ms=RECLAIMED_MS + 1),
        lambda t: Outcome.FENCED,
    ),
    "extend": (
        lambda s, t: s.extend("q", [("a", t)], now_ms=RECLAIMED_MS + 1),
        lambda t: [("a", t)],
    ),
    "charge": (
        lambda s, t: s.charge("q", "a", t, 0, "worker_lost", now_ms=RECLAIMED_MS + 1),
        lambda t: None,
    ),
    "start": (lambda s, t: s.start("q", "a", t), lambda t: Outcome.FENCED),
}


def assert_fenced(
    op: str, store: JobStore, client: redis.Redis, prefix: str, stale: str, live: str
) -> None:
    """Settle with the ``stale`` token: nothing of the ``live`` claim changes; counted."""
    before = snapshot(client, prefix)
    call, expected = STALE[op]
    assert call(store, stale) == expected(stale)
    verb = op.removesuffix("_many")
    if verb == "ack":
        # The one mark a stale ack leaves: the job has completed once.
        before[store.keys("q").job("a").encode()][b"completed"] = b"1"
    fenced = store.keys("q").metrics("fenced").encode()
    assert before.pop(fenced, None) is None
    after = snapshot(client, prefix)
    assert after.pop(fenced) == {b"count": b"1", f"reason:{verb}".encode(): b"1"}
    assert after == before
    assert store.fenced("q") == {verb: 1}
    k = store.keys("q")
    row = store.job("q", "a")
    assert (row["state"], row["stalled"]) == ("active", "0")
    assert live_token(row.get("claim"), row["deliveries"]) == live
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
    assert store.ack("q", "a", live) is Outcome.OK
    assert store.metrics("q")["completed"] == 1


@pytest.mark.parametrize("op", sorted(STALE))
@pytest.mark.parametrize("how", ["lapsed", "lost_writes"])
def test_a_stale_settle_leaves_the_live_claim_untouched(
    how: str, op: str, client: redis.Redis, prefix: str
) -> None:
    # lapsed: the stale claim's lease lapsed and the job was claimed again.
    # lost_writes: the server forgot the stale claim and claimed the job again
    # under the same delivery count and owner; on the count alone, the stale
    # claim's worker would renew, settle or charge the live claim of another run.
    store = JobStore(client, prefix + "emq", LEASE_MS)
    if how == "lapsed":
        stale, live = reclaimed(store)
        client.hdel(store.keys("q").job("a"), "started")
    else:
        stale, live = reclaimed_after_lost_writes(store, client, prefix)
    assert_fenced(op, store, client, prefix, stale, live)


@pytest.mark.parametrize("op", sorted(STALE))
def test_a_row_claimed_by_an_earlier_version_keeps_the_delivery_count_check(
    op: str, client: redis.Redis, prefix: str
) -> None:
    # A rolling upgrade: a claim made by a version that kept no claim id leaves
    # none on the row; its worker names the delivery count, and settles as before.
    store = JobStore(client, prefix + "emq", LEASE_MS)
    reclaimed(store)
    k = store.keys("q")
    client.hdel(k.job("a"), "claim")
    if op == "start":
        client.hdel(k.job("a"), "started")
    # An earlier claim's count does not settle it ...
    assert_fenced(op, store, client, prefix, "1", "2")
    # ... while its own count does (the ack above ended it: claim "b", as before).
    [job] = store.claim("q", "w1", now_ms=RECLAIMED_MS + 2)
    assert job.id == "b"
    client.hdel(k.job("b"), "claim")
    assert store.extend("q", [("b", "1")], now_ms=RECLAIMED_MS + 3) == []
    assert store.extend("q", [("b", job.token)], now_ms=RECLAIMED_MS + 3) == [("b", job.token)]
    assert store.start("q", "b", "1") is Outcome.OK
    assert store.release("q", "b", "1", unless_started=True) is Outcome.STARTED
    assert store.ack("q", "b", "1") is Outcome.OK


def test_a_claim_id_left_by_a_later_claim_of_an_earlier_version_is_not_the_live_claim(
    client: redis.Redis, prefix: str
) -> None:
    # An earlier version claims a job this version claimed before: it counts
    # deliveries on, and leaves the old claim id on the row. That id is stale.
    store = JobStore(client, prefix + "emq", LEASE_MS)
    stale, live = reclaimed(store)
    k = store.keys("q")
    client.hset(k.job("a"), mapping={"claim": stale, "started": "2"})
    assert store.ack("q", "a", stale) is Outcome.FENCED
    assert store.ack("q", "a", "2") is Outcome.OK
    assert store.fenced("q") == {"ack": 1}
    assert live.startswith("2.")


@pytest.mark.parametrize("op", ["ack", "bury"])
def test_a_claim_forgotten_with_a_delayed_job_settles_nothing(
    op: str, client: redis.Redis, prefix: str
) -> None:
    # The server forgets the claim and the promotion before it: the job waits
    # for its ETA again, and runs when due.
    store = JobStore(client, prefix + "emq", LEASE_MS)
    store.enqueue("q", "a", b"{}", now_ms=1, eta_ms=500, task_id="t-a")
    before = dump_keys(client, prefix)
    assert store.promote("q", now_ms=600) == 1
    [lost] = store.claim("q", "w1", now_ms=700)
    forget_writes(client, prefix, before)
    kept = snapshot(client, prefix)
    if op == "ack":
        assert store.ack("q", "a", lost.token) is Outcome.NOT_FOUND
    else:
        assert store.bury("q", "a", lost.token, "rejected", "", now_ms=800) is Outcome.NOT_FOUND
    assert snapshot(client, prefix) == kept
    assert store.promote("q", now_ms=900) == 1
    assert [j.id for j in store.claim("q", "w2", now_ms=900)] == ["a"]


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
    assert store.ack("q", "a", token_of(store, "q", "a")) is Outcome.LEASE_LOST
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
    [job] = store.claim("q", "w1", now_ms=CLAIMED_MS)
    store.start("q", "a", job.token)
    [swept] = store.sweep("q", max_stalled=0, now_ms=CLAIMED_MS + store.lease_ms + 1)
    assert swept.outcome == "dead"
    k = store.keys("q")
    assert client.zcard(k.dead) == 1
    # The task finished after all: a completed job is never left in the morgue.
    assert store.ack("q", "a", job.token) is Outcome.DEAD
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
    [old_tag] = keeper.hold(store, "q", [(first.id, first.token)], interval_ms=60_000)
    assert store.reap("q", now_ms=CLAIMED_MS + store.lease_ms + 1) == ["a"]
    assert keeper.renew_once(now_ms=CLAIMED_MS + store.lease_ms + 2) == [old_tag]
    assert keeper.is_lost(old_tag)
    # The same process claims the job again, under the same owner.
    [second] = store.claim("q", keeper.owner, now_ms=RECLAIMED_MS)
    [new_tag] = keeper.hold(store, "q", [(second.id, second.token)], interval_ms=60_000)
    assert (old_tag, new_tag) == (f"a#{first.token}", f"a#{second.token}")
    assert first.token.startswith("1.") and second.token.startswith("2.")
    assert not keeper.is_lost(new_tag)
    assert keeper.renew_once(now_ms=RECLAIMED_MS + 3000) == []
    k = store.keys("q")
    assert client.zscore(k.active, "a") == RECLAIMED_MS + 3000 + store.lease_ms
    # A hold of a tag found lost before starts renewing it again too.
    keeper.hold(store, "q", [("a", second.token)], interval_ms=60_000)
    assert keeper.renew_once(now_ms=RECLAIMED_MS + 4000) == []
    assert client.zscore(k.active, "a") == RECLAIMED_MS + 4000 + store.lease_ms


LOSSES: dict[str, tuple[Callable[[JobStore, str], Any], Any]] = {
    "ack": (lambda s, t: s.ack("q", "a", t), Outcome.OK),
    "release": (lambda s, t: s.release("q", "a", t), Outcome.COMPLETED),
    "bury": (
        lambda s, t: s.bury("q", "a", t, "rejected", "", now_ms=RECLAIMED_MS + 1),
        Outcome.COMPLETED,
    ),
    "charge": (
        lambda s, t: [x.outcome for x in [s.charge("q", "a", t, 0, "worker_lost")] if x],
        ["completed"],
    ),
    "sweep": (
        lambda s, t: [
            (x.id, x.outcome) for x in s.sweep("q", 0, now_ms=RECLAIMED_MS + LEASE_MS + 1)
        ],
        [("a", "completed")],
    ),
    "reap": (lambda s, t: s.reap("q", now_ms=RECLAIMED_MS + LEASE_MS + 1), []),
}


@pytest.mark.parametrize("op", sorted(LOSSES))
def test_a_job_an_older_claim_completed_is_never_run_again_nor_dead_lettered(
    op: str, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", LEASE_MS)
    stale, live = reclaimed(store)
    # The first worker finishes after all: its ack is fenced, the job marked done.
    assert store.ack("q", "a", stale) is Outcome.FENCED
    call, expected = LOSSES[op]
    assert call(store, live) == expected
    # However the live claim ends (acked, released, dead-lettered, lapsed, charged
    # with a budget of 0), the job is gone and counted completed once.
    assert store.job("q", "a") == {}
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"b"]
    assert client.llen(store.keys("q").wake) == 1
    metrics = store.metrics("q")
    assert (metrics["completed"], metrics["failed"], metrics["recovered"]) == (1, 0, 0)
