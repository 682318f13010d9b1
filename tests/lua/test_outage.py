"""The outage rule: a lease that lapsed while no sweep could run is not a stall.

A live worker renews at least every half lease, so its lease can lapse only if
Redis did not hear from it for half a lease. A sweep that finds no sweep ran
for over half a lease takes the gap as an outage and grants each lease that
lapsed in it (or within half a lease after it) one more lease, once.
"""

from __future__ import annotations

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome

LEASE = 5000


def started_claim(store: JobStore, job_id: str, now_ms: int) -> str:
    store.enqueue("q", job_id, b"{}", now_ms=now_ms)
    [job] = store.claim("q", "w", now_ms=now_ms)
    assert store.start("q", job_id, job.token) is Outcome.OK
    return job.token


def outcomes(store: JobStore, now_ms: int) -> dict[str, str]:
    return {s.id: s.outcome for s in store.sweep("q", max_stalled=1, now_ms=now_ms)}


def test_a_gap_of_half_a_lease_or_less_is_no_outage(store: JobStore) -> None:
    assert outcomes(store, 1000) == {}
    started_claim(store, "a", 1000)  # deadline 6000
    assert outcomes(store, 3500) == {}  # every sweep within half a lease of the last
    assert outcomes(store, 6000) == {"a": "recovered"}


def test_a_lapse_in_a_gap_longer_than_half_a_lease_is_granted_one_more_lease(
    store: JobStore,
) -> None:
    assert outcomes(store, 1000) == {}
    token = started_claim(store, "a", 1000)  # deadline 6000
    [swept] = store.sweep("q", max_stalled=1, now_ms=9000)  # last sweep 8 s ago
    assert (swept.id, swept.outcome, swept.stalled) == ("a", "graced", 0)
    k = store.keys("q")
    assert store.client.zscore(k.active, "a") == 9000 + LEASE
    assert store.job("q", "a")["state"] == "active"
    assert store.metrics("q")["stalled"] == 0
    # Its keeper renews it as usual.
    assert store.extend("q", [("a", token)], now_ms=9500) == []
    assert store.client.zscore(k.active, "a") == 9500 + LEASE


def test_grace_is_granted_once_per_deadline(store: JobStore) -> None:
    assert outcomes(store, 1000) == {}
    started_claim(store, "a", 1000)
    assert outcomes(store, 9000) == {"a": "graced"}  # deadline now 14000
    for t in range(10_000, 14_000, 1000):
        assert outcomes(store, t) == {}
    # The worker really is gone: nobody renewed, so the next lapse counts.
    assert outcomes(store, 14_000) == {"a": "recovered"}
    assert store.job("q", "a")["stalled"] == "1"


def test_the_window_covers_half_a_lease_after_the_outage(store: JobStore) -> None:
    assert outcomes(store, 1000) == {}
    started_claim(store, "early", 1000)  # deadline 6000: lapsed in the gap
    started_claim(store, "soon", 4000)  # deadline 9000: after it, within half a lease
    started_claim(store, "late", 6000)  # deadline 11000: more than half a lease after
    assert outcomes(store, 8000) == {"early": "graced"}  # the gap (1000, 8000]
    assert outcomes(store, 9000) == {"soon": "graced"}  # 9000 <= 8000 + 2500
    assert outcomes(store, 11_000) == {"late": "recovered"}  # 11000 > 10500


def test_unstarted_and_completed_claims_in_an_outage(store: JobStore) -> None:
    assert outcomes(store, 1000) == {}
    store.enqueue("q", "idle", b"{}", now_ms=1000)
    store.enqueue("q", "done", b"{}", now_ms=1000)
    old = {j.id: j.token for j in store.claim("q", "w", count=2, now_ms=1000)}
    # Both lapse with sweeps running; "done" is claimed again and the old claim's
    # ack completes it.
    assert outcomes(store, 3000) == outcomes(store, 5000) == {}
    assert outcomes(store, 6000) == {"idle": "requeued", "done": "requeued"}
    # Both lapsed before they started: each is claimed alone (claim.lua).
    again = {j.id: j.deliveries for _ in "ab" for j in store.claim("q", "w2", now_ms=6000)}
    assert store.ack("q", "done", old["done"]) is Outcome.FENCED
    # No sweep for 5 s: both lapse in the gap. The completed job is done, not graced.
    assert outcomes(store, 12_000) == {"idle": "graced", "done": "completed"}
    assert again["idle"] == 2


def test_a_lease_that_lapsed_too_soon_after_the_last_sweep_is_counted(store: JobStore) -> None:
    # A live worker renews at least every half lease, and Redis answered the
    # sweep at 3000: a lease still due at 5000 had not been renewed since 0,
    # so its worker was gone before the gap, outage or not.
    assert outcomes(store, 0) == {}
    started_claim(store, "a", 0)  # deadline 5000
    assert outcomes(store, 2000) == {}
    assert outcomes(store, 3000) == {}
    assert outcomes(store, 9000) == {"a": "recovered"}  # 5000 <= 3000 + 2500


def sweep_vouching(store: JobStore, now_ms: int, since: str) -> dict[str, str]:
    return {s.id: s.outcome for s in store.sweep("q", max_stalled=1, now_ms=now_ms, since=since)}


def test_a_sweeper_with_no_pass_behind_it_vouches_for_no_outage(store: JobStore) -> None:
    # The only worker died at 1000 and its replacement sweeps first at 9000:
    # no sweep ran for 8 s, but nobody saw Redis go away. Its lapse is a lapse.
    assert outcomes(store, 1000) == {}
    started_claim(store, "a", 1000)  # deadline 6000
    assert sweep_vouching(store, 9000, since="") == {"a": "recovered"}
    assert store.metrics("q")["stalled"] == 1


def test_a_sweeper_cut_off_since_its_last_pass_vouches_for_the_gap(store: JobStore) -> None:
    assert sweep_vouching(store, 1000, since="") == {}
    started_claim(store, "a", 1000)  # deadline 6000
    # Its own last pass was at 1000: it could not reach Redis for 8 s.
    assert sweep_vouching(store, 9000, since="1000") == {"a": "graced"}
    assert store.metrics("q")["stalled"] == 0


def test_a_sweeper_that_never_got_through_takes_the_gap_since_any_sweep(
    store: JobStore,
) -> None:
    assert outcomes(store, 1000) == {}
    started_claim(store, "a", 1000)
    # Started while Redis was away ("0"): the gap since the last sweep counts.
    assert sweep_vouching(store, 9000, since="0") == {"a": "graced"}


def test_a_sweep_record_older_than_the_sweepers_own_pass_is_a_rollback(
    store: JobStore,
) -> None:
    # The server came back from a snapshot taken at 1000; the sweeper's own last
    # pass (at 3000) was lost with it. The gap runs from the record's 1000.
    assert outcomes(store, 1000) == {}
    started_claim(store, "a", 1000)  # deadline 6000
    assert sweep_vouching(store, 6500, since="5800") == {"a": "graced"}


def test_the_pass_tells_the_caller_the_servers_clock(store: JobStore) -> None:
    assert store.sweep("q", max_stalled=1, now_ms=4321).now_ms == 4321
    assert store.sweep("q", max_stalled=1).now_ms is not None
    assert store.charge("q", "nosuch", "1.x", 1, "worker_lost", now_ms=4321) is None
