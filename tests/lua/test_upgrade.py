"""Rolling upgrades: this version's scripts and those of 0.2.0 on one queue, both ways.

The 0.2.0 scripts (before claim ids: the token is the delivery count, ``started``
holds it) are kept verbatim in ``tests/lua/upgrade/v0_2_0`` (see its README).
During an upgrade, workers of both versions claim from the same queue and every
worker's sweep examines every lapsed claim, whoever made it: a started claim
past its lease is charged a stall by either sweep, a claim that never started is
requeued uncounted by either (see docs/versions.md, "Rolling upgrades").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_emq.store.codec import pack, unpack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.keys import QueueKeys
from celery_emq.store.outcomes import Outcome
from tests.conftest import sweeps_ran_until

OLD = Path(__file__).parent / "upgrade" / "v0_2_0"
T0 = 1000
LEASE_MS = 5000  # the store fixture's lease


class OldScripts:
    """The 0.2.0 scripts, called with the KEYS and ARGV its wrappers sent."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        #: The message each job was last claimed with, as stored.
        self.messages: dict[str, bytes] = {}
        self.scripts = {
            name: client.register_script((OLD / f"{name}.lua").read_text("utf-8"))
            for name in ("enqueue", "claim", "start", "ack", "extend", "sweep")
        }

    def enqueue(self, k: QueueKeys, job_id: str, message: bytes, now_ms: int) -> int:
        keys = [
            *(k.pending, k.wake, k.seq, k.job(job_id), k.lanes, k.expires, k.base),
            *(k.msg(job_id), k.delayed, k.etas),
        ]
        args = [job_id, message, 0, now_ms, 0, "", "", "", ""]
        return int(self.scripts["enqueue"](keys=keys, args=args))

    def claim(self, k: QueueKeys, now_ms: int, owner: str = "old", count: int = 10) -> list[Any]:
        """Claim as 0.2.0 did; return ``(id, deliveries)`` per job (the token is the count)."""
        keys = [k.pending, k.active, k.wake, k.seq, k.head, k.lanes, k.cursor, k.expires, k.base]
        reply = self.scripts["claim"](keys=keys, args=[now_ms, LEASE_MS, owner, count, 0, 0])
        self.messages.update({reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 5)})
        return [(reply[i].decode(), int(reply[i + 3])) for i in range(0, len(reply), 5)]

    def start(self, k: QueueKeys, job_id: str, token: int) -> int:
        return int(self.scripts["start"](keys=[k.job(job_id)], args=[token]))

    def ack(self, k: QueueKeys, job_id: str, token: int) -> int:
        keys = [k.active, k.pending, k.wake, k.dead, k.metrics("completed"), k.base]
        [code] = self.scripts["ack"](keys=keys, args=[job_id, token])
        return int(code)

    def extend(self, k: QueueKeys, now_ms: int, claims: Sequence[tuple[str, Any]]) -> list[bytes]:
        args = [LEASE_MS, now_ms, *(x for claim in claims for x in claim)]
        return list(self.scripts["extend"](keys=[k.active, k.job_prefix], args=args))

    def sweep(
        self, k: QueueKeys, now_ms: int, max_stalled: int, claims: Sequence[tuple[str, Any]] = ()
    ) -> list[tuple[str, str, int]]:
        """Sweep as 0.2.0 did; return ``(id, outcome, stalled)`` per job examined."""
        keys = [k.active, k.pending, k.wake, k.head, k.dead, k.lanes, k.base]
        args = [now_ms, 500, max_stalled, "lease_expired", LEASE_MS]
        reply = self.scripts["sweep"](keys=keys, args=[*args, *(x for c in claims for x in c)])
        return [
            (reply[i].decode(), reply[i + 1].decode(), int(reply[i + 2]))
            for i in range(0, len(reply), 4)
        ]


@pytest.fixture
def old(client: redis.Redis) -> OldScripts:
    return OldScripts(client)


def lapsed_at(store: JobStore) -> int:
    """The time one lease after T0, with sweeps on record until just before it (no outage)."""
    now = T0 + LEASE_MS + 1
    sweeps_ran_until(store, "q", now - 1)
    return now


# -- an old sweep on this version's claims --------------------------------------------


@pytest.mark.parametrize(
    ("max_stalled", "outcome", "state"), [(1, "recovered", "pending"), (0, "dead", "dead")]
)
def test_an_old_sweep_charges_a_stall_on_a_started_claim_of_this_version(
    store: JobStore, old: OldScripts, max_stalled: int, outcome: str, state: str
) -> None:
    # A task that kills a new worker after it starts: an old worker's sweep finds the lapse.
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    [claim] = store.claim("q", "new", now_ms=T0)
    assert store.start("q", "a", claim.token) is Outcome.OK
    assert old.sweep(store.keys("q"), lapsed_at(store), max_stalled) == [("a", outcome, 1)]
    row = store.job("q", "a")
    assert (row["state"], row["stalled"]) == (state, "1")
    assert store.metrics("q")["stalled"] == 1


def test_an_old_sweep_requeues_a_never_started_claim_of_this_version_uncounted(
    store: JobStore, old: OldScripts
) -> None:
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    store.enqueue("q", "b", b'{"id":"b"}', now_ms=2)
    [first, _] = store.claim("q", "new", count=2, now_ms=T0)
    assert store.start("q", "a", first.token) is Outcome.OK
    k = store.keys("q")
    # "b" was prefetched and never started: requeued, no stall; "a" started: one stall.
    assert sorted(old.sweep(k, lapsed_at(store), 5)) == [
        ("a", "recovered", 1),
        ("b", "requeued", 0),
    ]
    assert store.job("q", "b")["stalled"] == "0"
    assert store.metrics("q")["stalled"] == 1


def test_a_start_lost_with_its_claim_is_not_read_as_started_by_either_sweep(
    store: JobStore, old: OldScripts
) -> None:
    # The claim that started lapses and is swept; the next claim (same row) never starts.
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    [first] = store.claim("q", "new", now_ms=T0)
    assert store.start("q", "a", first.token) is Outcome.OK
    now = lapsed_at(store)
    assert old.sweep(store.keys("q"), now, 5) == [("a", "recovered", 1)]
    [second] = store.claim("q", "new", now_ms=now)
    assert second.deliveries == 2
    # The old worker's start, naming the lapsed claim's count, is fenced.
    assert old.start(store.keys("q"), "a", 1) == 5
    later = now + LEASE_MS + 1
    sweeps_ran_until(store, "q", later - 1)
    assert old.sweep(store.keys("q"), later, 5) == [("a", "requeued", 1)]
    [third] = store.claim("q", "new", now_ms=later)
    again = later + LEASE_MS + 1
    sweeps_ran_until(store, "q", again - 1)
    [swept] = store.sweep("q", max_stalled=5, now_ms=again)
    assert (swept.id, swept.outcome, swept.stalled) == ("a", "requeued", 1)
    assert third.deliveries == 3


# -- this version's scripts on claims of the old one ----------------------------------


def test_this_version_renews_and_acks_a_claim_of_the_old_one(
    store: JobStore, old: OldScripts
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    assert old.claim(k, T0) == [("a", 1)]
    assert old.start(k, "a", 1) == 0
    # A new worker never holds an old claim, but its scripts settle one named by its count.
    assert store.extend("q", [("a", "1")], now_ms=T0 + 100) == []
    assert store.client.zscore(k.active, "a") == T0 + 100 + LEASE_MS
    assert store.extend("q", [("a", "2")], now_ms=T0 + 100) == [("a", "2")]
    assert store.ack("q", "a", "1") is Outcome.OK
    assert store.job("q", "a") == {}


@pytest.mark.parametrize("started", [True, False])
def test_this_sweep_charges_a_started_claim_of_the_old_one_and_requeues_one_that_never_started(
    store: JobStore, old: OldScripts, started: bool
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    assert old.claim(k, T0) == [("a", 1)]
    if started:
        assert old.start(k, "a", 1) == 0
    [swept] = store.sweep("q", max_stalled=5, now_ms=lapsed_at(store), max_lapsed=3)
    if started:
        assert (swept.outcome, swept.stalled) == ("recovered", 1)
        assert store.job("q", "a").get("lapsed") is None
    else:
        assert (swept.outcome, swept.stalled) == ("requeued", 0)
        assert store.job("q", "a")["lapsed"] == "1"


def test_claims_of_both_versions_take_turns_on_one_row(store: JobStore, old: OldScripts) -> None:
    """New claim, old claim, new claim on one job: each sweep charges exactly the started ones."""
    k = store.keys("q")
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    now = T0
    seen = []
    for version, starts, sweeper in [
        ("new", True, "old"),
        ("old", True, "new"),
        ("new", False, "new"),
        ("old", False, "old"),
        ("new", True, "new"),
        ("old", True, "old"),
    ]:
        if version == "new":
            [claim] = store.claim("q", "new", now_ms=now)
            if starts:
                assert store.start("q", "a", claim.token) is Outcome.OK
        else:
            [(_, count)] = old.claim(k, now)
            if starts:
                assert old.start(k, "a", count) == 0
        now += LEASE_MS + 1
        sweeps_ran_until(store, "q", now - 1)
        if sweeper == "new":
            [swept] = store.sweep("q", max_stalled=10, now_ms=now)
            seen.append((swept.outcome, swept.stalled))
        else:
            [(_, outcome, stalled)] = old.sweep(k, now, 10)
            seen.append((outcome, stalled))
    assert seen == [
        ("recovered", 1),
        ("recovered", 2),
        ("requeued", 2),
        ("requeued", 2),
        ("recovered", 3),
        ("recovered", 4),
    ]
    assert store.job("q", "a")["deliveries"] == "6"


def test_an_old_worker_neither_honours_nor_counts_lapses(store: JobStore, old: OldScripts) -> None:
    """What docs/versions.md says of suspects in a mixed fleet: only this version keeps them."""
    k = store.keys("q")
    for n, i in enumerate(["p", "x"]):
        store.enqueue("q", i, b"{}", now_ms=n + 1)
    [claim] = store.claim("q", "new", now_ms=T0)
    assert claim.id == "p"
    now = lapsed_at(store)
    [swept] = store.sweep("q", max_stalled=5, now_ms=now, max_lapsed=3)
    assert (swept.outcome, store.job("q", "p")["lapsed"]) == ("requeued", "1")
    # A suspect now: this version's claim takes it only alone; 0.2.0's takes it in a batch.
    assert old.claim(k, now, count=2) == [("p", 2), ("x", 1)]
    later = now + LEASE_MS + 1
    sweeps_ran_until(store, "q", later - 1)
    # Neither started: the old sweep requeues both without counting a lapse.
    assert sorted(old.sweep(k, later, 5)) == [("p", "requeued", 0), ("x", "requeued", 0)]
    assert (store.job("q", "p")["lapsed"], store.job("q", "x").get("lapsed")) == ("1", None)
    # An old start of it leaves its lapses in place; this version's start clears them.
    [(_, count), _] = old.claim(k, later, count=2)
    assert old.start(k, "p", count) == 0
    assert store.job("q", "p")["lapsed"] == "1"


def test_jobs_published_by_either_version_are_claimed_and_settled_by_the_other(
    store: JobStore, old: OldScripts
) -> None:
    k = store.keys("q")
    # Both pack a message as celery_emq/store/codec.py does (unchanged since 0.2.0).
    assert old.enqueue(k, "from-old", pack('{"id": "from-old"}'), now_ms=1) == 0
    store.enqueue("q", "from-new", b'{"id":"from-new"}', now_ms=2)
    [claim] = store.claim("q", "new", now_ms=T0)
    assert (claim.id, unpack(claim.payload)) == ("from-old", b'{"id": "from-old"}')
    assert store.start("q", "from-old", claim.token) is Outcome.OK
    assert store.ack("q", "from-old", claim.token) is Outcome.OK
    assert old.claim(k, T0) == [("from-new", 1)]
    assert unpack(old.messages["from-new"]) == b'{"id":"from-new"}'
    assert old.start(k, "from-new", 1) == 0
    assert old.ack(k, "from-new", 1) == 0
    assert store.job("q", "from-old") == store.job("q", "from-new") == {}
    assert store.client.exists(k.msg("from-old"), k.msg("from-new"), k.pending, k.active) == 0


def test_this_sweep_charges_a_claim_whose_start_holds_its_claim_id(store: JobStore) -> None:
    """Builds between claim ids and 0.3.0 recorded the claim id in ``started``: still a start."""
    store.enqueue("q", "a", b'{"id":"a"}', now_ms=1)
    [claim] = store.claim("q", "new", now_ms=T0)
    store.client.hset(store.keys("q").job("a"), "started", claim.token)
    [swept] = store.sweep("q", max_stalled=5, now_ms=lapsed_at(store))
    assert (swept.outcome, swept.stalled) == ("recovered", 1)
