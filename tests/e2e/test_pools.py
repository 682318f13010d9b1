"""End to end on every worker pool: prefork, threads, solo, gevent and eventlet.

For each pool: a task longer than several leases keeps its lease (and so does a
delivery prefetched behind it); a SIGKILLed worker's task runs again on a
survivor within a lease and a sweep; a task that kills its worker is
dead-lettered after ``max_stalled + 1`` runs. Then the bound: where a pool
cannot renew (a C call that keeps the GIL under solo or threads, a greenlet that
blocks the gevent or eventlet hub), the lease lapses within one lease of the
block, a survivor counts the stall and runs the job again; a worker alone counts
no stall against itself. See docs/pools.md.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError
from celery_emq.store.jobstore import JobStore

from .harness import Worker, lapsed_leases, suite_app, wait_for

pytestmark = pytest.mark.slow

POOLS = ["prefork", "threads", "solo", "gevent", "eventlet"]
#: Pools that run a task in the worker process itself (prefork runs it in a child).
IN_PROCESS = ["threads", "solo", "gevent", "eventlet"]
LEASE_MS = 2000
# Sweeps well within half a lease: a longer gap between them reads as an outage.
SWEEP_S = 0.5
ENV = {"EMQ_E2E_LEASE_MS": str(LEASE_MS), "EMQ_E2E_SWEEP_S": str(SWEEP_S)}
QUIET = {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
#: What a loaded two-core machine may add to a bound: worker wake-up, claim, task start.
SLACK_S = 2.5


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def texts(client: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in client.lrange(key, 0, -1)]


def times(client: redis.Redis, key: str) -> list[float]:
    return [float(v) for v in client.lrange(key, 0, -1)]


def metrics(store: JobStore) -> dict[str, int]:
    return {k: v for k, v in store.metrics("celery").items() if k != "retried"}


def start_recorded(client: redis.Redis, store: JobStore) -> bool:
    """Whether the one leased job's row says its task started."""
    ids = client.zrange(store.keys("celery").active, 0, -1)
    return len(ids) == 1 and bool(store.job("celery", ids[0].decode()).get("started"))


def start_pool(
    start_worker: Callable[..., Worker], pool: str, *names: str, **env: str
) -> list[Worker]:
    """Start one worker of ``pool`` (concurrency 1) per name, in parallel; wait until ready."""
    workers = [
        start_worker("-P", pool, "-c", "1", name=name, ready=False, **{**ENV, **env})
        for name in names
    ]
    for w in workers:
        w.wait_ready()
    return workers


def node(worker_or_hostname: Worker | str) -> str:
    name = worker_or_hostname if isinstance(worker_or_hostname, str) else worker_or_hostname.name
    return name.split("@")[0]


@pytest.fixture
def capp(redis_url: str, prefix: str) -> Any:
    c = suite_app(redis_url, prefix, LEASE_MS)
    yield c
    c.close()


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", LEASE_MS)


@pytest.mark.parametrize("pool", POOLS)
def test_a_task_longer_than_several_leases_keeps_its_lease_and_runs_once(
    pool: str,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    store: JobStore,
) -> None:
    seconds = 3 * LEASE_MS / 1000
    # Published before the worker starts, so its first claim takes both: the
    # second waits prefetched (leased, not started) for as long as the first runs.
    long = capp.send_task("tests.e2e.app.sleepy", args=(seconds, "long"))
    behind = capp.send_task("tests.e2e.app.sleepy", args=(0, "behind"))
    start_pool(start_worker, pool, pool)
    k = store.keys("celery")
    lapsed: list[bytes] = []
    most_held = 0
    least_left_ms = float("inf")
    deadline = time.monotonic() + seconds + 20
    while client.llen(prefix + "done") < 2 and time.monotonic() < deadline:
        now_ms = time.time() * 1000
        leases = client.zrange(k.active, 0, -1, withscores=True)
        lapsed += [job for job, at in leases if at < now_ms]
        most_held = max(most_held, len(leases))
        least_left_ms = min([least_left_ms, *(at - now_ms for _job, at in leases)])
        time.sleep(0.2)
    print(f"\n[{pool}] least lease left while held: {least_left_ms:.0f} ms of {LEASE_MS}")
    assert (long.get(timeout=10), behind.get(timeout=10)) == ("long", "behind")
    assert lapsed == []
    assert most_held == 2
    assert runs(client, prefix) == {"long": 1, "behind": 1}
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    assert metrics(store) == {"completed": 2, "recovered": 0, "stalled": 0, "failed": 0}


@pytest.mark.parametrize("pool", POOLS)
def test_a_sigkilled_workers_task_runs_again_on_a_survivor(
    pool: str,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    store: JobStore,
) -> None:
    workers = {w.name: w for w in start_pool(start_worker, pool, "a", "b")}
    result = capp.send_task("tests.e2e.app.sleepy_here", args=(2, "k"))
    wait_for(lambda: client.llen(prefix + "ran-on:k") == 1, 15)
    # A prefork worker records the start when it hears its child accepted the
    # job, sent with its acks within settle_delay_ms; a worker killed before
    # that has its job requeued uncounted. The kill here is of a started task.
    wait_for(lambda: start_recorded(client, store), 5)
    victim = workers[node(texts(client, prefix + "ran-on:k")[0])]
    [survivor] = [w for w in workers.values() if w is not victim]
    killed_at = time.time()
    victim.kill()
    wait_for(lambda: client.llen(prefix + "ran-on:k") == 2, 20)
    recovery_s = times(client, prefix + "started:k")[-1] - killed_at
    bound_s = LEASE_MS / 1000 + SWEEP_S
    print(f"\n[{pool}] recovery after SIGKILL: {recovery_s:.2f} s (lease + sweep = {bound_s} s)")
    assert recovery_s <= bound_s + SLACK_S
    assert [node(n) for n in texts(client, prefix + "ran-on:k")] == [victim.name, survivor.name]
    assert result.get(timeout=15) == "k"
    assert runs(client, prefix) == {"k": 2}
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    assert metrics(store) == {"completed": 1, "recovered": 1, "stalled": 1, "failed": 0}


@pytest.mark.parametrize("pool", POOLS)
def test_a_task_that_kills_its_worker_is_dead_lettered_after_its_budget(
    pool: str,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    store: JobStore,
) -> None:
    # max_stalled=1: two runs, then the morgue. Published before any worker
    # runs, so the innocents are prefetched by the process the poison kills.
    poisoned = capp.send_task("tests.e2e.app.poison", args=("p",))
    innocents = [capp.send_task("tests.e2e.app.sleepy", args=(0, f"i{i}")) for i in range(3)]

    def settled() -> bool:
        counts = store.counts("celery")
        return counts["pending"] == 0 and counts["active"] == 0

    # Under prefork the poison kills a pool child and the worker lives on; in
    # the other pools it kills the worker, and the next one started recovers it.
    pool_args = ("-P", pool, "-c", "1")
    exits: list[int | None] = []
    deadline = time.monotonic() + 60
    while len(exits) < 6 and time.monotonic() < deadline:
        name = f"{pool}{len(exits)}"
        w = start_worker(*pool_args, name=name, ready=False, EMQ_E2E_PREFETCH="4", **ENV)
        wait_for(
            lambda w=w: w.proc.poll() is not None or settled(),
            max(0.1, deadline - time.monotonic()),
        )
        exits.append(w.proc.poll())
        if exits[-1] is None:
            break
    reason = "worker_lost" if pool == "prefork" else "lease_expired"
    assert exits == ([None] if pool == "prefork" else [-signal.SIGKILL, -signal.SIGKILL, None])
    assert runs(client, prefix) == {"p": 2, "i0": 1, "i1": 1, "i2": 1}
    assert [int(x) for x in client.lrange(prefix + "stall-header:p", 0, -1)] == [0, 1]
    assert [r.get(timeout=10) for r in innocents] == ["i0", "i1", "i2"]
    with pytest.raises(StalledJobError, match=rf"stalled 2 times \({reason}\)"):
        poisoned.get(timeout=10)
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}, 10
    )
    [dead_id] = [j.decode() for j in client.zrange(store.keys("celery").dead, 0, -1)]
    row = store.job("celery", dead_id)
    assert json.loads(row["payload"])["headers"]["id"] == poisoned.id
    assert (row["state"], row["stalled"], row["reason"]) == ("dead", "2", reason)
    signals = {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()}
    assert signals == {f"tests.e2e.app.poison:{poisoned.id}:{reason}": 1}
    # Only the poison was charged: the innocents went back uncounted.
    assert metrics(store) == {"completed": 3, "recovered": 1, "stalled": 2, "failed": 1}


#: How each pool's renewals are stopped: a C call that keeps the GIL stops every
#: thread of the process; the unpatched ``time.sleep`` stops every greenlet.
BLOCKED = [("threads", "gil"), ("solo", "gil"), ("gevent", "hub"), ("eventlet", "hub")]


def last_deadline_of_first_claim(
    client: redis.Redis, store: JobStore, job_id: str, timeout: float = 30
) -> float:
    """Return the last lease deadline (s) of the job's first claim, watched until it ends."""
    k = store.keys("celery")
    last_ms = 0.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with client.pipeline() as pipe:  # one MULTI: the deadline and the claim it belongs to
            deadline_ms, token = (
                pipe.zscore(k.active, job_id).hget(k.job(job_id), "deliveries").execute()
            )
        if deadline_ms is None or token != b"1":
            break
        last_ms = deadline_ms
        time.sleep(0.05)
    else:
        raise AssertionError(f"the first claim of {job_id} still held after {timeout} s")
    assert last_ms, "the first claim ended before it was seen"
    return last_ms / 1000


@pytest.mark.parametrize(("pool", "how"), BLOCKED)
def test_where_a_pool_cannot_renew_the_lease_lapses_and_a_survivor_runs_the_job_again(
    pool: str,
    how: str,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    store: JobStore,
) -> None:
    block_s = 3 * LEASE_MS / 1000
    workers = {w.name: w for w in start_pool(start_worker, pool, "a", "b")}
    result = capp.send_task("tests.e2e.app.block_first_run", args=(block_s, "b", how))
    wait_for(lambda: client.llen(prefix + "ran-on:b") == 1, 15)
    blocked = workers[node(texts(client, prefix + "ran-on:b")[0])]
    [survivor] = [w for w in workers.values() if w is not blocked]
    [job_id] = [j.decode() for j in client.zrange(store.keys("celery").active, 0, -1)]
    lapsed_at = last_deadline_of_first_claim(client, store, job_id)
    wait_for(lambda: client.llen(prefix + "ran-on:b") == 2, 20)
    [block_began, rerun_at] = times(client, prefix + "started:b")
    lapse_s, rerun_s = lapsed_at - block_began, rerun_at - block_began
    print(
        f"\n[{pool}, {how}] blocked {block_s} s: lease lapsed {lapse_s:.2f} s after the block"
        f" began, the job ran again after {rerun_s:.2f} s (lease {LEASE_MS} ms, sweep {SWEEP_S} s)"
    )
    # Nothing renewed the lease during the block, and a survivor's sweep took it over.
    assert lapse_s <= LEASE_MS / 1000 + 0.1
    assert rerun_s <= LEASE_MS / 1000 + SWEEP_S + SLACK_S
    assert [node(n) for n in texts(client, prefix + "ran-on:b")] == [blocked.name, survivor.name]
    # The blocked run finishes too: the job ran twice, and completed once.
    wait_for(lambda: client.llen(prefix + "done") == 2, block_s + 10)
    assert result.get(timeout=10) == "b"
    assert runs(client, prefix) == {"b": 2}
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    assert metrics(store) == {"completed": 1, "recovered": 1, "stalled": 1, "failed": 0}


def test_a_call_that_keeps_the_gil_in_a_prefork_child_does_not_stop_renewal(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    store: JobStore,
) -> None:
    # The lease keeper runs in the worker's main process, not in the child. A
    # second worker stands by: had the lease lapsed, it would have run the job again.
    block_s = 3 * LEASE_MS / 1000
    start_pool(start_worker, "prefork", "a", "b")
    result = capp.send_task("tests.e2e.app.block_first_run", args=(block_s, "b", "gil"))
    k = store.keys("celery")
    lapsed: list[bytes] = []
    deadline = time.monotonic() + block_s + 20
    while client.llen(prefix + "done") < 1 and time.monotonic() < deadline:
        lapsed += lapsed_leases(client, k.active)
        time.sleep(0.2)
    assert result.get(timeout=10) == "b"
    assert lapsed == []
    assert runs(client, prefix) == {"b": 1}
    assert len(times(client, prefix + "unblocked:b")) == 1
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    assert metrics(store) == {"completed": 1, "recovered": 0, "stalled": 0, "failed": 0}


@pytest.mark.parametrize(("pool", "how"), BLOCKED)
def test_a_worker_alone_held_up_past_its_lease_counts_no_stall_against_itself(
    pool: str,
    how: str,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    store: JobStore,
) -> None:
    # No other worker sweeps while this one is held up. When it runs again, its
    # own sweep must not charge the claim it holds and is about to finish.
    block_s = 2 * LEASE_MS / 1000
    start_pool(start_worker, pool, "alone")
    result = capp.send_task("tests.e2e.app.block_first_run", args=(block_s, "b", how))
    k = store.keys("celery")
    lapsed: list[bytes] = []
    deadline = time.monotonic() + block_s + 20
    while client.llen(prefix + "done") < 1 and time.monotonic() < deadline:
        lapsed += lapsed_leases(client, k.active)
        time.sleep(0.2)
    assert result.get(timeout=10) == "b"
    assert lapsed, "the block did not outlast the lease"
    assert runs(client, prefix) == {"b": 1}
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    assert metrics(store) == {"completed": 1, "recovered": 0, "stalled": 0, "failed": 0}
