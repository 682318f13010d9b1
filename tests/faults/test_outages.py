"""The broker's own faults under real workers: restarts, killed connections, a pause.

Each test runs ``tests.e2e.app`` workers against a ``redis-server`` it starts on
a port of its own and asserts from the ledger on the suite's Redis (runs per
task, completions, the worker each run was on).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.e2e.app import client_app
from tests.e2e.harness import Worker, wait_for

from .servers import RedisServer

pytestmark = pytest.mark.slow

LEASE_MS = 3000
ENV = {"EMQ_E2E_LEASE_MS": str(LEASE_MS), "EMQ_E2E_SWEEP_S": "1", "EMQ_E2E_PREFETCH": "4"}
QUIET = {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def done(client: redis.Redis, prefix: str) -> set[str]:
    return {v.decode() for v in client.lrange(prefix + "done", 0, -1)}


def first_start_after(client: redis.Redis, prefix: str, tags: list[str], t0: float) -> dict:
    """Return, per worker node, the earliest start of any of ``tags`` after ``t0``."""
    firsts: dict[str, float] = {}
    with client.pipeline(transaction=False) as pipe:
        for tag in tags:
            pipe.lrange(prefix + "started:" + tag, 0, -1)
            pipe.lrange(prefix + "ran-on:" + tag, 0, -1)
        replies = pipe.execute()
    for started, nodes in zip(replies[::2], replies[1::2], strict=True):
        for at, node in zip(started, nodes, strict=False):
            t = float(at)
            name = node.decode().split("@")[0]
            if t >= t0 and t < firsts.get(name, float("inf")):
                firsts[name] = t
    return firsts


def settle(store: JobStore, timeout: float = 15) -> None:
    """Wait until nothing is pending, active or dead; else say what is left."""
    try:
        wait_for(lambda: store.counts("celery") == QUIET, timeout)
    except AssertionError:
        k = store.keys("celery")
        left = {
            state: {
                i.decode(): store.job("celery", i.decode()) for i in store.client.zrange(key, 0, -1)
            }
            for state, key in (("pending", k.pending), ("active", k.active), ("dead", k.dead))
        }
        for rows in left.values():
            for row in rows.values():
                row.pop("payload", None)
        raise AssertionError(f"not settled: {store.counts('celery')}: {left}") from None


def until_each_consumes(
    capp: object, client: redis.Redis, prefix: str, names: list[str], t0: float, label: str
) -> dict[str, float]:
    """Publish short tasks in small batches until every worker ran one after ``t0``.

    Returns each worker's first start after ``t0``, in seconds; bounded at 30 s.
    """
    tags: list[str] = []
    firsts: dict[str, float] = {}
    while time.time() - t0 < 30:
        batch = [f"{label}{len(tags) + i}" for i in range(4)]
        publish(capp, batch, 0.2)
        tags += batch
        time.sleep(0.5)
        firsts = first_start_after(client, prefix, tags, t0)
        if sorted(firsts) == sorted(names):
            break
    wait_for(lambda: done(client, prefix) >= set(tags), 60)
    return {n: round(t - t0, 2) for n, t in sorted(firsts.items())}


def explain(client: redis.Redis, prefix: str, tags: list[str]) -> dict[str, list[str]]:
    """Where each run of ``tags`` started (node) and when."""
    return {
        t: [
            f"{n.decode()} at {float(at):.3f}"
            for n, at in zip(
                client.lrange(prefix + "ran-on:" + t, 0, -1),
                client.lrange(prefix + "started:" + t, 0, -1),
                strict=False,
            )
        ]
        for t in tags
    }


def publish(capp: object, tags: list[str], seconds: float) -> None:
    for tag in tags:
        capp.send_task("tests.e2e.app.sleepy_here", args=(seconds, tag))  # type: ignore[attr-defined]


def test_redis_restarted_with_aof_loses_nothing_and_runs_nothing_twice(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    broker = redis_server(aof=True)
    workers = [fault_worker(broker, "-c", "2", name=n, **ENV) for n in ("a", "b")]
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    tags = [f"t{i}" for i in range(300)]
    publish(capp, tags, 0.05)
    wait_for(lambda: len(done(client, prefix)) >= 60, 60)

    broker.stop()  # SIGKILL: a crash; appendfsync always kept every acknowledged write
    time.sleep(2 * LEASE_MS / 1000)  # down for two leases
    broker.start()
    back = time.time()

    wait_for(lambda: done(client, prefix) == set(tags), 120)
    firsts = {
        n: round(t - back, 2) for n, t in first_start_after(client, prefix, tags, back).items()
    }
    if sorted(firsts) != ["a", "b"]:  # the backlog drained on one worker: more work tells
        firsts = {**until_each_consumes(capp, client, prefix, ["a", "b"], back, "after"), **firsts}
    print(f"\nAOF restart: first start after Redis came back, per worker (s): {firsts}")
    assert sorted(firsts) == ["a", "b"] and max(firsts.values()) < 30
    assert all(w.proc.poll() is None for w in workers)

    counted = runs(client, prefix)
    twice = {t: n for t, n in counted.items() if n != 1}
    assert twice == {}, f"ran more than once: {explain(client, prefix, list(twice))}"
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    settle(store)
    metrics = store.metrics("celery")
    assert (metrics["stalled"], metrics["failed"]) == (0, 0), metrics
    capp.close()


def test_redis_restarted_without_persistence_workers_consume_again(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    broker = redis_server(aof=False)
    workers = [fault_worker(broker, "-c", "2", name=n, **ENV) for n in ("a", "b")]
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    before = [f"b{i}" for i in range(100)]
    publish(capp, before, 0.05)
    wait_for(lambda: len(done(client, prefix)) >= 20, 60)
    broker.stop()
    time.sleep(2)
    broker.start()  # empty: every queued job, lease and counter is gone
    back = time.time()
    sizes = {w.name: w.log.stat().st_size for w in workers}

    firsts = until_each_consumes(capp, client, prefix, ["a", "b"], back, "after")
    print(f"\nno persistence: first start after Redis came back, per worker (s): {firsts}")
    assert sorted(firsts) == ["a", "b"] and max(firsts.values()) < 30
    assert all(w.proc.poll() is None for w in workers)
    twice = {t: n for t, n in runs(client, prefix).items() if t.startswith("after") and n != 1}
    assert twice == {}, f"ran more than once: {explain(client, prefix, list(twice))}"
    # No error loop: what the workers logged since Redis came back stays small.
    time.sleep(3)
    grown = {w.name: w.log.stat().st_size - sizes[w.name] for w in workers}
    assert all(g < 200_000 for g in grown.values()), grown
    capp.close()


def test_killed_connections_lose_nothing_and_consuming_resumes(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    broker = redis_server()
    workers = [fault_worker(broker, "-c", "2", name=n, **ENV) for n in ("a", "b")]
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    tags = [f"k{i}" for i in range(200)]
    publish(capp, tags, 0.05)
    admin = broker.client()
    killed = 0
    for kind in ("normal", "pubsub", "normal", "pubsub"):
        wait_for(lambda n=killed: len(done(client, prefix)) >= 30 * (n + 1), 60)
        killed += 1
        admin.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes")
    wait_for(lambda: done(client, prefix) == set(tags), 120)
    admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub", "SKIPME", "yes")
    at = time.time()
    firsts = until_each_consumes(capp, client, prefix, ["a", "b"], at, "after")
    print(f"\nCLIENT KILL: first start after the kill, per worker (s): {firsts}")
    assert sorted(firsts) == ["a", "b"] and max(firsts.values()) < 10, firsts
    assert all(w.proc.poll() is None for w in workers)
    twice = {t: n for t, n in runs(client, prefix).items() if n != 1}
    assert twice == {}, f"ran more than once: {explain(client, prefix, list(twice))}"
    # Remote control still reaches both workers over fresh pub/sub connections.
    replies = capp.control.ping(timeout=3)  # type: ignore[attr-defined]
    assert len(replies) == 2
    store = JobStore(admin, prefix + "emq", LEASE_MS)
    settle(store)
    assert store.metrics("celery")["stalled"] == 0
    capp.close()


def test_a_pause_longer_than_two_leases_is_not_a_stall(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    broker = redis_server()
    workers = [fault_worker(broker, "-c", "2", name=n, **ENV) for n in ("a", "b")]
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    tags = [f"p{i}" for i in range(20)]
    publish(capp, tags, 1.5)
    wait_for(lambda: sum(runs(client, prefix).values()) >= 4, 30)
    broker.client().execute_command("CLIENT", "PAUSE", 2 * LEASE_MS, "ALL")
    wait_for(lambda: done(client, prefix) == set(tags), 120)
    time.sleep(2 * LEASE_MS / 1000)  # anything run twice would show by now
    counted = runs(client, prefix)
    twice = [t for t, n in counted.items() if n != 1]
    assert twice == [], f"ran more than once: {explain(client, prefix, twice)}"
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    settle(store)
    metrics = store.metrics("celery")
    graced = sum(w.text().count("granted one more lease") for w in workers)
    print(
        f"\nCLIENT PAUSE {2 * LEASE_MS} ms: runs {sorted(set(counted.values()))}, "
        f"metrics {metrics}, sweeps that granted grace: {graced}"
    )
    assert (metrics["stalled"], metrics["recovered"], metrics["failed"]) == (0, 0, 0), metrics
    assert all(w.proc.poll() is None for w in workers)
    capp.close()


def test_a_threads_worker_runs_what_it_had_queued_once_across_a_restart(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    # One thread, four prefetched: three deliveries wait in the pool's executor
    # behind a running task when Redis goes away. Celery cancels none of them.
    broker = redis_server(aof=True)
    worker = fault_worker(broker, "-P", "threads", "-c", "1", name="t", **ENV)
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    publish(capp, ["long"], 4)
    wait_for(lambda: runs(client, prefix).get("long") == 1, 30)
    queued = [f"q{i}" for i in range(3)]
    publish(capp, queued, 0.1)
    time.sleep(0.5)  # claimed and handed to the executor
    broker.stop()
    time.sleep(2 * LEASE_MS / 1000)
    broker.start()
    wait_for(lambda: done(client, prefix) == {"long", *queued}, 60)
    time.sleep(2 * LEASE_MS / 1000)  # a second run would show by now
    twice = {t: n for t, n in runs(client, prefix).items() if n != 1}
    assert twice == {}, f"ran more than once: {explain(client, prefix, list(twice))}"
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    settle(store)
    assert store.metrics("celery")["stalled"] == 0
    assert worker.proc.poll() is None
    capp.close()


def test_scripts_flushed_by_the_server_are_loaded_again(
    redis_server: Callable[..., RedisServer],
) -> None:
    server = redis_server()
    client = server.client()
    store = JobStore(client, "flush", 30_000)
    assert store.enqueue("q", "a", "{}") is Outcome.OK
    client.script_flush()
    # The direct EVALSHA misses, the script is loaded again, the call goes through.
    assert store.enqueue("q", "b", "{}") is Outcome.OK
    assert store.enqueue("q", "b", "{}") is Outcome.DUPLICATE
    assert client.zcard(store.keys("q").pending) == 2
