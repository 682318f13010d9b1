"""One hung Cluster master delays only its own queues.

A private cluster of three masters without replicas (nothing fails over) and
``cluster-require-full-coverage no`` (the other masters keep serving their
slots while one is down). A worker consumes three queues: one on the master
that is hung (it also holds the expiry registry, ``emq:expiring``) and one on
each of the two others. While a long task runs on a healthy master, the sick
master is ``SIGSTOP``ped for four leases, then ``SIGCONT``ed; another long task
runs on the sick master, so the worker's keeper holds claims on both. The ledger stays
on the suite's Redis, so the fault cannot touch what the test counts.

Runs in the ``cluster`` nox session (``EMQ_TEST_CLUSTER=1``).
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from tests.conftest import CLUSTER, delete_prefix
from tests.e2e.app import client_app
from tests.e2e.harness import Worker, wait_for
from tests.topology.cluster_servers import REDIS_CLI, REDIS_SERVER, Cluster, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CLUSTER, reason="runs in the cluster nox session (EMQ_TEST_CLUSTER=1)"),
]

LEASE_MS = 3000
#: The keeper renews every third of a lease.
RENEW_S = LEASE_MS / 3000
#: How long the sick master is stopped: four leases.
HANG_S = 12.0
#: How soon a task published to a reachable queue must start.
START_WITHIN_S = 4.0


@pytest.fixture
def sick_cluster() -> Iterator[Cluster]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli on PATH")
    c = Cluster(replicas=0, config=("--cluster-require-full-coverage", "no"))
    try:
        c.start()
        yield c
    finally:
        for node in c.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
        c.stop()


@pytest.fixture
def ledger(redis_url: str) -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(redis_url)
    p = f"t{uuid.uuid4().hex[:10]}:"
    yield client, p
    delete_prefix(client, p)
    client.close()


def _slot_master(cluster: Cluster) -> dict[int, Node]:
    """The master of every slot, from ``CLUSTER SLOTS``."""
    live = next(n for n in cluster.nodes if n.alive)
    masters: dict[int, Node] = {}
    for start, end, master, *_ in live.client().execute_command("CLUSTER SLOTS"):
        node = next(n for n in cluster.nodes if n.port == int(master[1]))
        for slot in range(int(start), int(end) + 1):
            masters[slot] = node
    return masters


def _queues(cluster: Cluster, prefix: str) -> tuple[Node, str, str, str]:
    """The sick master, and a queue on it and on each of the two others.

    The sick master is the one holding ``emq:expiring``; the healthy queues'
    binding tables (kombu's ``_kombu.binding.<queue>``) are on healthy masters too.
    """
    masters = _slot_master(cluster)

    def master(key: str) -> Node:
        return masters[key_slot(key.encode())]

    sick = master(f"{prefix}emq:expiring")
    found: dict[int, str] = {}
    sick_queue = ""
    for i in itertools.count():
        q = f"q{i}"
        node = master(f"{prefix}emq:{{{q}}}:pending")
        if node is sick:
            sick_queue = sick_queue or q
        elif node.port not in found and master(f"{prefix}_kombu.binding.{q}") is not sick:
            found[node.port] = q
        if sick_queue and len(found) == 2:
            long_q, fresh_q = found.values()
            return sick, sick_queue, long_q, fresh_q
        assert i < 10_000


def _started(client: redis.Redis, prefix: str, tag: str) -> list[float]:
    return [float(x) for x in client.lrange(prefix + "started:" + tag, 0, -1)]


def test_a_hung_master_delays_only_its_own_queues(
    sick_cluster: Cluster, ledger: tuple[redis.Redis, str], redis_url: str, tmp_path: Path
) -> None:
    client, prefix = ledger
    sick, sick_q, long_q, fresh_q = _queues(sick_cluster, prefix)
    env = {
        "EMQ_E2E_BROKER": sick_cluster.url,
        "EMQ_E2E_REDIS": redis_url,
        "EMQ_E2E_LEDGER": redis_url,
        "EMQ_E2E_PREFIX": prefix,
        "EMQ_E2E_LEASE_MS": str(LEASE_MS),
        "EMQ_E2E_SWEEP_S": "1",
        # One stall would dead-letter the long task.
        "EMQ_E2E_MAX_STALLED": "0",
    }
    worker = Worker(env, tmp_path / "w.log", "w", "-c", "3", "-Q", f"{long_q},{fresh_q},{sick_q}")
    capp = client_app(redis_url, prefix, LEASE_MS, ledger=redis_url, broker=sick_cluster.url)
    samples: list[tuple[float, float]] = []
    sampling = threading.Event()
    try:
        worker.wait_ready()
        for q in (long_q, fresh_q, sick_q):
            capp.send_task("tests.e2e.app.sleepy", (0, f"warm-{q}"), queue=q)
        wait_for(lambda: client.llen(prefix + "done") == 3, 30)

        long_task = capp.send_task("tests.e2e.app.sleepy", (HANG_S + 6, "long"), queue=long_q)
        # One runs on the sick master too: its claim is renewed by the same keeper.
        sick_task = capp.send_task("tests.e2e.app.sleepy", (HANG_S + 6, "sick"), queue=sick_q)
        wait_for(lambda: _started(client, prefix, "long") and _started(client, prefix, "sick"), 10)
        active = f"{prefix}emq:{{{long_q}}}:active"
        long_master = _slot_master(sick_cluster)[key_slot(active.encode())]

        def sample() -> None:
            reader = long_master.client()
            while not sampling.is_set():
                scores = reader.zrange(active, 0, -1, withscores=True)
                if scores:
                    samples.append((time.time(), scores[0][1] / 1000))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(1)
        assert sick.proc is not None
        sick.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(2)  # past the cluster's node timeout: the others mark it failed

        fresh_at = time.time()
        capp.send_task("tests.e2e.app.sleepy", (0, "fresh"), queue=fresh_q)
        while not _started(client, prefix, "fresh") and time.time() < stopped_at + HANG_S:
            time.sleep(0.1)
        time.sleep(max(0.0, stopped_at + HANG_S - time.time()))
        sick.proc.send_signal(signal.SIGCONT)
        resumed_at = time.time()
        wait_for(lambda: _started(client, prefix, "fresh"), 30)
        fresh_delay = _started(client, prefix, "fresh")[0] - fresh_at
        capp.send_task("tests.e2e.app.sleepy", (0, "back"), queue=sick_q)
        wait_for(lambda: _started(client, prefix, "back"), 30)
        back_delay = _started(client, prefix, "back")[0] - resumed_at

        assert long_task.get(timeout=30) == "long"
        assert sick_task.get(timeout=30) == "sick"
        sampling.set()
        sampler.join(5)
    finally:
        sampling.set()
        worker.kill()
    log = worker.text()
    runs = {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}
    masters = _slot_master(sick_cluster)
    dead = [f"{prefix}emq:{{{q}}}:dead" for q in (long_q, sick_q)]
    # The long task's lease through the hang: when each renewal came (its
    # deadline moved on), and how close it came to lapsing.
    during = [(t, d) for t, d in samples if stopped_at - RENEW_S <= t <= resumed_at + RENEW_S]
    renewed = [t for (_, before), (t, d) in itertools.pairwise(during) if d > before]
    gaps = [b - a for a, b in itertools.pairwise([during[0][0], *renewed, during[-1][0]])]
    figures = {
        "fresh_delay_s": round(fresh_delay, 2),
        "back_delay_s": round(back_delay, 2),
        "longest_renewal_gap_s": round(max(gaps), 2),
        "closest_to_lapsing_s": round(min(d - t for t, d in during), 2),
        "runs": runs,
        "dead": sum(masters[key_slot(k.encode())].client().zcard(k) for k in dead),
        "consumer_restarted": "Connection to broker lost" in log,
    }
    print(f"\n{figures}")
    # A task on a healthy master starts within seconds of its publish, while
    # the sick master hangs; the sick master's queue, within seconds of its return.
    assert figures["fresh_delay_s"] < START_WITHIN_S, (figures, log[-3000:])
    assert figures["back_delay_s"] < START_WITHIN_S + 2, (figures, log[-3000:])
    # The long tasks ran once, were not dead-lettered, succeeded: the one on
    # the sick master lapsed in its outage, which is no stall.
    assert [runs[t] for t in ("long", "sick", "fresh", "back")] == [1, 1, 1, 1], figures
    assert (long_task.state, sick_task.state) == ("SUCCESS", "SUCCESS")
    assert figures["dead"] == 0, figures
    # Its lease was renewed throughout the hang: every renewal came within two
    # renewal intervals of the one before, and the lease never lapsed.
    assert len(during) > HANG_S * 5, len(during)
    assert figures["longest_renewal_gap_s"] < 2 * RENEW_S + 0.5, figures
    assert figures["closest_to_lapsing_s"] > 0, figures
    # The worker's consumer never restarted for the sick master.
    assert not figures["consumer_restarted"], (figures, log[-3000:])
