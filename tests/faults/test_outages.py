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

from celery_emq.store import JobStore
from tests.e2e.app import client_app
from tests.e2e.harness import Worker, wait_for

from .servers import RedisServer

pytestmark = pytest.mark.slow

LEASE_MS = 3000
ENV = {"EMQ_E2E_LEASE_MS": str(LEASE_MS), "EMQ_E2E_SWEEP_S": "1", "EMQ_E2E_PREFETCH": "4"}
QUIET = {"pending": 0, "active": 0, "dead": 0}


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
    firsts = first_start_after(client, prefix, tags, back)
    print(
        f"\nfirst start after Redis came back, per worker (s): "
        f"{ {n: round(t - back, 2) for n, t in sorted(firsts.items())} }"
    )
    # Both workers consume again (the run may have finished on one: then the later batch tells).
    after = [f"after{i}" for i in range(20)]
    publish(capp, after, 0.3)
    wait_for(lambda: done(client, prefix) >= set(after), 60)
    firsts.update(
        {n: t for n, t in first_start_after(client, prefix, after, back).items() if n not in firsts}
    )
    assert sorted(firsts) == ["a", "b"]
    assert all(t - back < 30 for t in firsts.values())
    assert all(w.proc.poll() is None for w in workers)

    counted = runs(client, prefix)
    twice = {t: n for t, n in counted.items() if n != 1}
    assert twice == {}, f"ran more than once: {twice}"
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    wait_for(lambda: store.counts("celery") == QUIET, 10)
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

    after = [f"after{i}" for i in range(40)]
    publish(capp, after, 0.2)
    wait_for(lambda: done(client, prefix) >= set(after), 60)
    firsts = first_start_after(client, prefix, after, back)
    assert sorted(firsts) == ["a", "b"]
    assert all(t - back < 30 for t in firsts.values())
    assert all(w.proc.poll() is None for w in workers)
    assert {t: n for t, n in runs(client, prefix).items() if t in after and n != 1} == {}
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
    at = time.time()
    wait_for(lambda: done(client, prefix) == set(tags), 120)
    after = [f"after{i}" for i in range(20)]
    admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub", "SKIPME", "yes")
    at = time.time()
    publish(capp, after, 0.3)
    wait_for(lambda: done(client, prefix) >= set(after), 60)
    firsts = first_start_after(client, prefix, after, at)
    assert sorted(firsts) == ["a", "b"]
    assert all(t - at < 10 for t in firsts.values()), firsts
    assert all(w.proc.poll() is None for w in workers)
    assert {t: n for t, n in runs(client, prefix).items() if n != 1} == {}
    # Remote control still reaches both workers over fresh pub/sub connections.
    replies = capp.control.ping(timeout=3)  # type: ignore[attr-defined]
    assert len(replies) == 2
    store = JobStore(admin, prefix + "emq", LEASE_MS)
    wait_for(lambda: store.counts("celery") == QUIET, 10)
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
    assert {t: n for t, n in counted.items() if n != 1} == {}
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    metrics = store.metrics("celery")
    assert (metrics["stalled"], metrics["recovered"], metrics["failed"]) == (0, 0, 0), metrics
    assert all(w.proc.poll() is None for w in workers)
    capp.close()
