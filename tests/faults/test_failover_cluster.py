"""A Redis Cluster master killed under a real worker: its replica takes over.

The worker consumes ``celery`` from a private cluster (three masters, one
replica each, ``cluster-node-timeout`` 1000 ms) while the test publishes at a
steady rate; a third of the way in, the master owning the queue's slot is
SIGKILLed. The ledger (runs, starts) stays on the suite's Redis, so the fault
cannot touch what the test counts. Replication is asynchronous: a publish the
dead master acknowledged but had not yet sent to its replica is lost, and the
test reports how many were, with the gap and the tasks that ran twice; with
``wait_replicas`` (a ``WAIT`` on the queue's master after each publish and
settle) none acknowledged may be lost.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import redis

from tests.e2e.app import client_app
from tests.e2e.harness import Worker, wait_for
from tests.topology.cluster_servers import REDIS_CLI, REDIS_SERVER, Cluster

pytestmark = pytest.mark.slow

LEASE_MS = 3000
ENV = {"EMQ_E2E_LEASE_MS": str(LEASE_MS), "EMQ_E2E_SWEEP_S": "1", "EMQ_E2E_PREFETCH": "4"}
#: Tasks published, and how many a second.
TASKS = 600
RATE = 40


@pytest.fixture
def cluster() -> object:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli on PATH")
    c = Cluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _replicates(cluster: Cluster, node: object) -> bool:
    """Whether a restarted node is back as a replica with its link up."""
    try:
        info = node.client().info("replication")  # type: ignore[attr-defined]
    except redis.RedisError:
        return False
    return info["role"] == "slave" and info.get("master_link_status") == "up"


def _pinged(capp: object) -> bool:
    """Whether a worker answers ``inspect ping``; a call that meets the dead node is a no."""
    try:
        return bool(capp.control.ping(timeout=1))  # type: ignore[attr-defined]
    except redis.RedisError:
        return False


def starts(client: redis.Redis, prefix: str, tags: list[str]) -> dict[str, list[float]]:
    with client.pipeline(transaction=False) as pipe:
        for tag in tags:
            pipe.lrange(prefix + "started:" + tag, 0, -1)
        replies = pipe.execute()
    return {t: [float(x) for x in r] for t, r in zip(tags, replies, strict=True)}


@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["async", "wait_replicas"])
def test_a_killed_master_is_replaced_and_the_worker_consumes_again(
    cluster: Cluster,
    client: redis.Redis,
    redis_url: str,
    prefix: str,
    tmp_path: Path,
    wait_replicas: int,
) -> None:
    # With wait_replicas, a publish counts once the replica holds it: the
    # promoted replica has every acknowledged task.
    options = {"wait_replicas": wait_replicas, "wait_timeout_ms": 1000} if wait_replicas else {}
    env = {
        "EMQ_E2E_BROKER_OPTIONS": json.dumps(options),
        "EMQ_E2E_BROKER": cluster.url,
        "EMQ_E2E_REDIS": redis_url,
        "EMQ_E2E_LEDGER": redis_url,
        "EMQ_E2E_PREFIX": prefix,
        **ENV,
    }
    worker = Worker(env, tmp_path / "w.log", "w", "-c", "4")
    try:
        worker.wait_ready()
        capp = client_app(
            redis_url,
            prefix,
            LEASE_MS,
            ledger=redis_url,
            broker=cluster.url,
            broker_options=options,
        )
        victim = cluster.master_of(f"{prefix}emq:{{celery}}:pending")
        heir = cluster.replica_of(victim)
        published: dict[str, float] = {}
        refused: list[str] = []
        killed_at = promoted_at = rejoined_at = 0.0
        began = time.monotonic()
        for i in range(TASKS):
            if i == TASKS // 3:
                victim.kill()
                killed_at = time.time()
            if killed_at and not promoted_at and cluster.role(heir) == "master":
                promoted_at = time.time()
                # As an operator would: the dead node comes back, as the replica
                # of its heir (until then, no replica can confirm a WAIT).
                victim.start()
            if promoted_at and not rejoined_at and _replicates(cluster, victim):
                rejoined_at = time.time()
            tag = f"t{i}"
            try:
                capp.send_task("tests.e2e.app.sleepy_here", args=(0, tag))
                published[tag] = time.time()
            except Exception:
                refused.append(tag)
            time.sleep(max(0.0, began + (i + 1) / RATE - time.monotonic()))
        if not promoted_at:
            wait_for(lambda: cluster.role(heir) == "master", 30)
            promoted_at = time.time()
        tags = list(published)
        ran = lambda: {t for t, s in starts(client, prefix, tags).items() if s}  # noqa: E731
        try:
            wait_for(lambda: len(ran()) >= len(tags), 60, interval=0.5)
        except AssertionError:
            pass  # the lost ones are counted below
        # Redeliveries of leased work come within a lease or two.
        time.sleep(2 * LEASE_MS / 1000)
        started = starts(client, prefix, tags)
        capp.close()
    finally:
        worker.kill()
    lost = sorted(t for t in tags if not started[t])
    twice = sorted(t for t in tags if len(started[t]) > 1)
    after = [s[0] for t, s in started.items() if s and published[t] >= promoted_at]
    resumed_s = min(after) - promoted_at if after else None
    times = sorted(x for s in started.values() for x in s)
    gap_s = max((b - a for a, b in itertools.pairwise(times) if b >= killed_at), default=0)
    report = {
        "test": "failover_cluster",
        "wait_replicas": wait_replicas,
        "published": len(published),
        "refused": len(refused),
        "promoted_after_s": round(promoted_at - killed_at, 2),
        "rejoined_after_s": round(rejoined_at - killed_at, 2) if rejoined_at else None,
        "resumed_after_promotion_s": None if resumed_s is None else round(resumed_s, 2),
        "gap_s": round(gap_s, 2),
        "lost": len(lost),
        "ran_twice": len(twice),
        "lost_tags": lost[:20],
    }
    print(json.dumps(report))
    assert resumed_s is not None and resumed_s < 30, report
    if wait_replicas:
        assert not lost, report


def test_remote_control_answers_again_once_the_pubsub_node_died(
    cluster: Cluster, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    env = {
        "EMQ_E2E_BROKER": cluster.url,
        "EMQ_E2E_REDIS": redis_url,
        "EMQ_E2E_LEDGER": redis_url,
        "EMQ_E2E_PREFIX": prefix,
        "EMQ_E2E_CLIENT_NAME": "emq-failover",
        **ENV,
    }
    worker = Worker(env, tmp_path / "w.log", "w", "-c", "1")
    capp = client_app(redis_url, prefix, LEASE_MS, ledger=redis_url, broker=cluster.url)
    try:
        worker.wait_ready()
        wait_for(lambda: bool(capp.control.ping(timeout=1)), 30)
        # The worker's pub/sub connection (remote control) is on one node.
        [node] = [
            n
            for n in cluster.nodes
            if any(
                c.get("name") == "emq-failover" and int(c.get("psub", 0)) > 0
                for c in n.client().client_list()
            )
        ]
        node.kill()
        killed_at = time.time()
        wait_for(lambda: _pinged(capp), 30)
        answered_s = time.time() - killed_at
    finally:
        capp.close()
        worker.kill()
    print(json.dumps({"test": "pubsub_node_killed", "answered_after_s": round(answered_s, 2)}))
