from __future__ import annotations

import json
import threading

import pytest
import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Swept
from tests.conftest import bulk_enqueue, bulk_start, sweeps_ran_until, token_of


def lapse(
    store: JobStore, queue: str, ids: list[str], claimed_ms: int = 1000, started: bool = True
) -> None:
    """Enqueue and claim ``ids`` at ``claimed_ms``; their leases lapse at + lease_ms.

    With ``started`` each claim's task is recorded as started, so its lapse is a stall.
    """
    for i in ids:
        store.enqueue(queue, i, json.dumps({"id": i}), now_ms=1)
    claimed = store.claim(queue, "w1", count=len(ids), now_ms=claimed_ms)
    if started:
        bulk_start(store, queue, [(j.id, j.token) for j in claimed])


def claim_started(store: JobStore, queue: str, owner: str, now_ms: int, count: int = 1) -> None:
    """Claim up to ``count`` jobs at ``now_ms`` and record that each one's task started."""
    claimed = store.claim(queue, owner, count=count, now_ms=now_ms)
    bulk_start(store, queue, [(j.id, j.token) for j in claimed])


def after_lease(store: JobStore, claimed_ms: int = 1000) -> int:
    return claimed_ms + store.lease_ms + 1


def test_first_stall_recovers_to_the_front_with_budget_1(
    store: JobStore, client: redis.Redis
) -> None:
    lapse(store, "q", ["a"])
    store.enqueue("q", "b", b"{}", now_ms=2)
    [swept] = store.sweep("q", max_stalled=1, now_ms=after_lease(store))
    assert (swept.id, swept.outcome, swept.stalled) == ("a", "recovered", 1)
    assert swept.payload == b'{"id": "a"}'
    k = store.keys("q")
    assert client.zrange(k.pending, 0, -1) == [b"a", b"b"]
    assert client.zcard(k.active) == 0
    row = store.job("q", "a")
    assert (row["state"], row["stalled"], row["owner"], row["reason"]) == (
        "pending",
        "1",
        "",
        "lease_expired",
    )
    [entry] = json.loads(row["history"])
    assert entry == {
        "at": after_lease(store),
        "reason": "lease_expired",
        "owner": "w1",
        "stalled": 1,
    }
    assert store.metrics("q") == {
        "completed": 0,
        "recovered": 1,
        "stalled": 1,
        "failed": 0,
        "retried": 0,
    }


def test_second_stall_dead_letters_with_budget_1(store: JobStore, client: redis.Redis) -> None:
    lapse(store, "q", ["a"])
    store.sweep("q", max_stalled=1, now_ms=after_lease(store))
    [job] = store.claim("q", "w2", now_ms=50_000)
    assert job.stalled == 1  # the count travels with the job into its next claim
    store.start("q", "a", job.token)
    sweeps_ran_until(store, "q", after_lease(store, 50_000) - 1)
    [swept] = store.sweep("q", max_stalled=1, now_ms=after_lease(store, 50_000))
    assert (swept.outcome, swept.stalled) == ("dead", 2)
    k = store.keys("q")
    assert client.zscore(k.dead, "a") == after_lease(store, 50_000)
    assert client.zcard(k.pending) == client.zcard(k.active) == 0
    row = store.job("q", "a")
    assert (row["state"], row["last_error"], row["stalled"]) == ("dead", "stalled", "2")
    assert row["died_ms"] == str(after_lease(store, 50_000))
    assert "max_stalled=1" in row["error"]
    assert [h["owner"] for h in json.loads(row["history"])] == ["w1", "w2"]
    assert store.metrics("q")["failed"] == 1


def test_budget_0_dead_letters_on_the_first_stall(store: JobStore) -> None:
    lapse(store, "q", ["a"])
    [swept] = store.sweep("q", max_stalled=0, now_ms=after_lease(store))
    assert (swept.outcome, swept.stalled) == ("dead", 1)


def test_budget_none_never_dead_letters(store: JobStore) -> None:
    lapse(store, "q", ["a"])
    for n in range(1, 26):
        sweeps_ran_until(store, "q", after_lease(store, n * 100_000) - 1)
        [swept] = store.sweep("q", max_stalled=None, now_ms=after_lease(store, n * 100_000))
        assert (swept.outcome, swept.stalled) == ("recovered", n)
        claim_started(store, "q", "w", (n + 1) * 100_000)
    assert len(json.loads(store.job("q", "a")["history"])) == 20  # bounded history


def test_budget_3_recovers_three_times(store: JobStore) -> None:
    lapse(store, "q", ["a"])
    outcomes = []
    for n in range(1, 5):
        sweeps_ran_until(store, "q", after_lease(store, n * 100_000) - 1)
        outcomes.append(store.sweep("q", max_stalled=3, now_ms=after_lease(store, n * 100_000))[0])
        claim_started(store, "q", "w", (n + 1) * 100_000)
    assert [o.outcome for o in outcomes] == ["recovered"] * 3 + ["dead"]


def test_a_jobs_own_budget_wins(store: JobStore) -> None:
    store.enqueue("q", "strict", b"{}", now_ms=1, max_stalled=0)
    store.enqueue("q", "lenient", b"{}", now_ms=1, max_stalled=None)
    claim_started(store, "q", "w", 1000, count=2)
    swept = {s.id: s.outcome for s in store.sweep("q", max_stalled=1, now_ms=after_lease(store))}
    assert swept == {"strict": "dead", "lenient": "recovered"}


def test_only_lapsed_leases_are_examined(store: JobStore, client: redis.Redis) -> None:
    lapse(store, "q", ["old"], claimed_ms=1000)
    lapse(store, "q", ["fresh"], claimed_ms=9000)
    swept = store.sweep("q", max_stalled=1, now_ms=after_lease(store, 1000))
    assert [s.id for s in swept] == ["old"]
    assert client.zscore(store.keys("q").active, "fresh") is not None


def test_grouped_priority_is_kept_on_recovery(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "hi", b"{}", priority=0, now_ms=1)
    store.enqueue("q", "lo", b"{}", priority=9, now_ms=1)
    claim_started(store, "q", "w", 1000, count=2)
    store.enqueue("q", "new-hi", b"{}", priority=0, now_ms=2)
    store.sweep("q", max_stalled=1, now_ms=after_lease(store))
    # Recovered jobs go to the front of their own priority band.
    assert client.zrange(store.keys("q").pending, 0, -1) == [b"hi", b"new-hi", b"lo"]


def test_sweep_is_bounded_per_call_and_covers_8000_plus(
    store: JobStore, client: redis.Redis
) -> None:
    n = 8200
    bulk_enqueue(store, "q", n)
    claimed = 0
    while claimed < n:
        got = store.claim("q", "w", count=1000, now_ms=1000)
        bulk_start(store, "q", [(j.id, j.token) for j in got])
        claimed += len(got)
    k = store.keys("q")
    calls = []
    outcomes = set()
    while True:
        swept = store.sweep("q", max_stalled=1, limit=1000, now_ms=after_lease(store))
        calls.append(len(swept))
        outcomes |= {s.outcome for s in swept}
        if len(swept) < 1000:
            break
    assert calls == [1000] * 8 + [200]
    assert outcomes == {"recovered"}
    assert store.metrics("q")["stalled"] == n
    assert client.zcard(k.active) == 0
    assert client.zcard(k.pending) == n
    assert client.llen(k.wake) == n


def test_concurrent_sweepers_recover_each_job_once(store: JobStore, client: redis.Redis) -> None:
    n = 3000
    bulk_enqueue(store, "q", n)
    claimed = 0
    while claimed < n:
        got = store.claim("q", "w", count=1000, now_ms=1000)
        bulk_start(store, "q", [(j.id, j.token) for j in got])
        claimed += len(got)
    results: list[list[str]] = []
    lock = threading.Lock()

    def sweeper() -> None:
        mine = JobStore(
            redis.Redis(connection_pool=client.connection_pool), store.prefix, store.lease_ms
        )
        got: list[str] = []
        while True:
            swept = mine.sweep("q", max_stalled=1, limit=100, now_ms=after_lease(store))
            got += [s.id for s in swept]
            if not swept:
                break
        with lock:
            results.append(got)

    threads = [threading.Thread(target=sweeper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for got in results for i in got]
    assert len(every) == n and len(set(every)) == n
    assert {store.job("q", i)["stalled"] for i in ("0", "1500", "2999")} == {"1"}
    assert client.zcard(store.keys("q").pending) == n


def test_a_rerun_after_a_crash_recovers_nothing_twice(store: JobStore) -> None:
    lapse(store, "q", ["a", "b", "c"])
    # A sweeper that died after one call: one job moved; the restart re-reads the live set.
    first = store.sweep("q", max_stalled=1, limit=1, now_ms=after_lease(store))
    rest = store.sweep("q", max_stalled=1, limit=10, now_ms=after_lease(store))
    again = store.sweep("q", max_stalled=1, limit=10, now_ms=after_lease(store))
    assert len(first) == 1 and len(rest) == 2 and again == []
    assert {s.id for s in first + rest} == {"a", "b", "c"}


def test_charge_counts_a_stall_only_for_the_live_claim(
    store: JobStore, client: redis.Redis
) -> None:
    lapse(store, "q", ["a"], started=False)
    first = token_of(store, "q", "a")
    # A charge needs no start record (a pool process ran the task), only the live token.
    assert store.charge("q", "a", "2", 1, "worker_lost", now_ms=2000) is None
    assert store.job("q", "a")["stalled"] == "0"
    swept = store.charge("q", "a", first, 1, "worker_lost", now_ms=2000)
    assert swept is not None
    assert (swept.id, swept.outcome, swept.stalled) == ("a", "recovered", 1)
    assert store.job("q", "a")["reason"] == "worker_lost"
    [again] = store.claim("q", "w1", now_ms=3000)
    assert again.deliveries == 2
    assert store.charge("q", "a", first, 1, "worker_lost", now_ms=4000) is None
    swept = store.charge("q", "a", again.token, 1, "worker_lost", now_ms=4000)
    assert swept is not None and (swept.outcome, swept.stalled) == ("dead", 2)
    assert client.zscore(store.keys("q").dead, "a") == 4000
    assert store.metrics("q")["stalled"] == 2


def test_a_claim_that_never_started_is_requeued_uncounted(
    store: JobStore, client: redis.Redis
) -> None:
    lapse(store, "q", ["a"], started=False)
    [swept] = store.sweep("q", max_stalled=0, now_ms=after_lease(store))
    assert (swept.id, swept.outcome, swept.stalled) == ("a", "requeued", 0)
    k = store.keys("q")
    assert client.zrange(k.pending, 0, -1) == [b"a"]
    assert client.zcard(k.dead) == client.zcard(k.active) == 0
    row = store.job("q", "a")
    assert (row["state"], row["stalled"], row["reason"]) == ("pending", "0", "lease_expired")
    assert "history" not in row
    assert store.metrics("q") == {
        "completed": 0,
        "recovered": 0,
        "stalled": 0,
        "failed": 0,
        "retried": 0,
    }


@pytest.mark.parametrize("limit", [1, 7])
def test_reap_returns_lapsed_jobs_uncounted(
    store: JobStore, client: redis.Redis, limit: int
) -> None:
    lapse(store, "q", ["a", "b"])
    reaped = store.reap("q", limit=limit, now_ms=after_lease(store))
    assert len(reaped) == min(limit, 2)
    for i in reaped:
        row = store.job("q", i)
        assert (row["state"], row["stalled"], row["reason"]) == ("pending", "0", "lease_expired")
    assert client.zcard(store.keys("q").pending) == len(reaped)
    assert client.llen(store.keys("q").wake) == len(reaped)


def bury_at(store: JobStore, ids: list[str], died_ms: int) -> None:
    for i in ids:
        store.enqueue("q", i, b"{}", now_ms=1)
        store.bury("q", i, "rejected", "", now_ms=died_ms)


def trimmed(swept: list[Swept]) -> list[str]:
    return [s.id for s in swept if s.outcome == "trimmed"]


def test_sweep_applies_morgue_age_with_no_job_dying(store: JobStore, client: redis.Redis) -> None:
    bury_at(store, ["old1", "old2"], died_ms=1000)
    bury_at(store, ["new"], died_ms=9000)
    swept = store.sweep("q", max_stalled=1, now_ms=10_000, dead_max_age_ms=5000)
    assert sorted(trimmed(swept)) == ["old1", "old2"]
    k = store.keys("q")
    assert client.zrange(k.dead, 0, -1) == [b"new"]
    assert not client.exists(k.job("old1"), k.msg("old1"), k.job("old2"), k.msg("old2"))
    assert client.exists(k.job("new"), k.msg("new")) == 2


def test_sweep_applies_morgue_size_keeping_the_newest(store: JobStore, client: redis.Redis) -> None:
    for n in range(5):
        bury_at(store, [f"d{n}"], died_ms=1000 + n)
    swept = store.sweep("q", max_stalled=1, now_ms=2000, dead_max_size=2)
    assert trimmed(swept) == ["d0", "d1", "d2"]
    assert client.zrange(store.keys("q").dead, 0, -1) == [b"d3", b"d4"]


def test_sweep_retention_is_bounded_by_the_limit(store: JobStore, client: redis.Redis) -> None:
    for n in range(25):
        bury_at(store, [f"d{n}"], died_ms=1000 + n)
    swept = store.sweep("q", max_stalled=1, limit=7, now_ms=2000, dead_max_size=5)
    assert len(trimmed(swept)) == 7
    assert client.zcard(store.keys("q").dead) == 18


def test_sweep_without_bounds_or_on_a_charge_keeps_the_morgue(
    store: JobStore, client: redis.Redis
) -> None:
    bury_at(store, ["a", "b"], died_ms=1)
    assert store.sweep("q", max_stalled=1, now_ms=10**12) == []
    store.enqueue("q", "c", b"{}", now_ms=1)
    [job] = store.claim("q", "w1", now_ms=2)
    store.start("q", job.id, job.token)
    k = store.keys("q")
    claims = [("c", job.token)]
    charged = store.scripts.sweep(k, 3, 1, 5, "worker_lost", 5000, claims, dead_max_size=1)
    assert [(s.id, s.outcome) for s in charged] == [("c", "recovered")]
    assert client.zcard(k.dead) == 2


def test_a_sweep_pass_promotes_due_delayed_jobs(store: JobStore, client: redis.Redis) -> None:
    # The sweep is the one periodic script of a queue: it promotes due delayed
    # jobs too (a consumer promotes them when its wait ends at their due time).
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", eta_ms=5000, task_id="t-a", now_ms=1000)
    store.enqueue("q", "g", b"{}", eta_ms=5500, group="g1", priority=2, now_ms=1000)
    store.enqueue("q", "b", b"{}", eta_ms=9000, now_ms=1000)
    swept = store.sweep("q", 1, now_ms=6000)
    assert sorted((s.id, s.outcome) for s in swept) == [("a", "promoted"), ("g", "promoted")]
    assert store.counts("q") == {"pending": 2, "active": 0, "delayed": 1, "dead": 0}
    assert client.zrange(k.pending, 0, -1) == [b"a"]
    assert client.zrange(k.lane("g1"), 0, -1) == [b"g"]
    assert client.llen(k.wake) == 2
    assert client.hget(k.etas, "t-a") is None
    assert store.job("q", "a")["state"] == "pending"
    assert "task" not in store.job("q", "a")
    claimed = store.claim("q", "w1", count=2, now_ms=6001)[0]
    # A charge examines the named claims only: it promotes nothing.
    assert store.charge("q", claimed.id, claimed.token, 1, "worker_lost") is not None
    assert store.counts("q")["delayed"] == 1


def test_a_sweep_pass_promotes_at_most_its_limit(store: JobStore) -> None:
    for i in range(5):
        store.enqueue("q", f"d{i}", b"{}", eta_ms=2000 + i, now_ms=1000)
    swept = store.sweep("q", 1, limit=3, now_ms=9000)
    assert [s.id for s in swept] == ["d0", "d1", "d2"]
    assert store.counts("q")["delayed"] == 2


def test_a_sweep_given_the_registry_says_when_x_expires_queues_are_registered(
    store: JobStore,
) -> None:
    if not store.one_server:
        pytest.skip("on a Cluster the registry lies on another slot: the sweep does not read it")
    assert store.sweep("q", 1, now_ms=1000, registry=True) == []
    store.note_expiring("reply-q")
    assert store.sweep("q", 1, now_ms=2000, registry=True) == [Swept("", "expiring", 1, b"")]
    # Not asked, not read.
    assert store.sweep("q", 1, now_ms=3000) == []


def test_a_sweep_pass_gives_back_a_lost_wake_marker(store: JobStore, client: redis.Redis) -> None:
    # A consumer that popped a marker and died before its claim leaves jobs with
    # none: the next sweep pushes one, so an idle consumer's long wait ends.
    k = store.keys("q")
    store.enqueue("q", "a", b"{}", now_ms=1000)
    store.enqueue("q", "g", b"{}", group="g1", now_ms=1000)
    client.delete(k.wake)
    store.sweep("q", 1, now_ms=2000)
    assert client.llen(k.wake) == 1
    # Markers already there: none more.
    store.sweep("q", 1, now_ms=3000)
    assert client.llen(k.wake) == 1
    # Only a lane waits: a marker for it too.
    client.zrem(k.pending, "a")
    client.delete(k.wake)
    store.sweep("q", 1, now_ms=4000)
    assert client.llen(k.wake) == 1


def test_a_sweep_pass_pushes_no_marker_for_an_empty_lane(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "g", b"{}", group="g1", now_ms=1000)
    client.zrem(k.lane("g1"), "g")  # the lane's job gone, its group still listed
    client.delete(k.wake)
    store.sweep("q", 1, now_ms=2000)
    assert client.exists(k.lanes) == 1
    assert client.llen(k.wake) == 0
