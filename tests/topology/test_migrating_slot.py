"""A queue whose slot migrates waits alone: its master's other queues go on as usual.

A private cluster of three masters without replicas. A worker consumes three
queues: ``mig`` and ``same`` on one master (in different slots), ``other`` on
another. Long tasks run on all three; then ``mig``'s slot is left
mid-migration to the third master (``CLUSTER SETSLOT <slot> MIGRATING`` on its
master, ``IMPORTING`` on the target) for four leases: first with none of its
keys moved, then with some of them moved (scripts that touch both halves get
``TRYAGAIN``). A job of ``mig`` delayed to fall due during the migration, and
new tasks on ``same`` and ``other`` published during it, are then watched; at
the end the remaining keys move and the slot is given to the target. The
ledger and results stay on the suite's Redis.

Runs in the ``cluster`` nox session (``EMQ_TEST_CLUSTER=1``).
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from celery_emq.store.jobstore import JobStore
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
#: How long the slot stays mid-migration: four leases.
MIGRATE_S = 12.0
#: How soon a task published to a healthy queue must start.
START_WITHIN_S = 2.0
#: How long the tasks that fill the worker's last slots run.
HOG_S = 3.0


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli on PATH")
    c = Cluster(replicas=0)
    try:
        c.start()
        yield c
    finally:
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


def _slot(prefix: str, queue: str) -> int:
    return key_slot(f"{prefix}emq:{{{queue}}}:pending".encode())


def _queues(cluster: Cluster, prefix: str) -> tuple[Node, Node, str, str, str]:
    """The migrating queue's master and target, and queues ``mig``, ``same``, ``other``.

    No other key the test's worker uses (the expiry registry, the queues'
    binding tables) shares ``mig``'s slot.
    """
    masters = _slot_master(cluster)
    shared = {key_slot(f"{prefix}emq:expiring".encode())}
    by_master: dict[int, list[str]] = {}
    for i in itertools.count():
        q = f"q{i}"
        slot = _slot(prefix, q)
        if slot in shared:
            continue
        shared.add(key_slot(f"{prefix}_kombu.binding.{q}".encode()))
        queues = by_master.setdefault(masters[slot].port, [])
        queues.append(q)
        full = [p for p, qs in by_master.items() if len(qs) >= 2]
        others = [p for p in by_master if p not in full[:1]]
        if full and others:
            source_port = full[0]
            mig, same = by_master[source_port][:2]
            other = by_master[others[0]][0]
            source = next(n for n in cluster.nodes if n.port == source_port)
            target = next(
                n
                for n in cluster.nodes
                if n.port not in (source_port, masters[_slot(prefix, other)].port)
            )
            return source, target, mig, same, other
        assert i < 10_000


def _move_keys(source: Node, target: Node, slot: int, count: int | None) -> int:
    """MIGRATE up to ``count`` (None: all) of the slot's keys from source to target."""
    client = source.client()
    keys = client.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
    if count is not None:
        keys = keys[:count]
    if keys:
        client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    return len(keys)


def _started(client: redis.Redis, prefix: str, tag: str) -> list[float]:
    return [float(x) for x in client.lrange(prefix + "started:" + tag, 0, -1)]


def test_a_migrating_slot_holds_up_only_its_own_queue(
    cluster: Cluster, ledger: tuple[redis.Redis, str], redis_url: str, tmp_path: Path
) -> None:
    client, prefix = ledger
    source, target, mig_q, same_q, other_q = _queues(cluster, prefix)
    slot = _slot(prefix, mig_q)
    env = {
        "EMQ_E2E_BROKER": cluster.url,
        "EMQ_E2E_REDIS": redis_url,
        "EMQ_E2E_LEDGER": redis_url,
        "EMQ_E2E_PREFIX": prefix,
        "EMQ_E2E_LEASE_MS": str(LEASE_MS),
        "EMQ_E2E_SWEEP_S": "1",
        # One stall would dead-letter a long task.
        "EMQ_E2E_MAX_STALLED": "0",
        "EMQ_E2E_PREFETCH": "1",
    }
    queues = f"{mig_q},{same_q},{other_q}"
    worker = Worker(env, tmp_path / "w.log", "w", "-c", "5", "-Q", queues)
    capp = client_app(redis_url, prefix, LEASE_MS, ledger=redis_url, broker=cluster.url)
    samples: list[tuple[float, float]] = []
    sampling = threading.Event()
    migrating = False
    try:
        worker.wait_ready()
        for q in (mig_q, same_q, other_q):
            capp.send_task("tests.e2e.app.sleepy", (0, f"warm-{q}"), queue=q)
        wait_for(lambda: client.llen(prefix + "done") == 3, 30)

        longs = {
            q: capp.send_task("tests.e2e.app.sleepy", (MIGRATE_S + 6, f"long-{q}"), queue=q)
            for q in (mig_q, same_q, other_q)
        }
        wait_for(lambda: all(_started(client, prefix, f"long-{q}") for q in longs), 10)
        # Two short tasks fill the worker's last slots, so ``mig``'s next job
        # stays pending until the migration has begun: then its claims meet it.
        for q in (same_q, other_q):
            capp.send_task("tests.e2e.app.sleepy", (HOG_S, f"hog-{q}"), queue=q)
        wait_for(lambda: all(_started(client, prefix, f"hog-{q}") for q in (same_q, other_q)), 10)
        hogs_at = time.time()
        pending = [
            capp.send_task("tests.e2e.app.sleepy", (0, "mig-pend"), queue=mig_q),
            # Due in the migration: it waits, and runs once after it.
            capp.send_task("tests.e2e.app.sleepy", (0, "mig-due"), queue=mig_q, countdown=2),
        ]
        active = f"{prefix}emq:{{{same_q}}}:active"

        def sample() -> None:
            reader = source.client()
            while not sampling.is_set():
                scores = reader.zrange(active, 0, -1, withscores=True)
                if scores:
                    samples.append((time.time(), scores[0][1] / 1000))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(max(0.0, hogs_at + HOG_S - 1.5 - time.time()))
        source_id = source.client().execute_command("CLUSTER MYID")
        target_id = target.client().execute_command("CLUSTER MYID")
        target.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        migrating = True
        began = time.time()

        time.sleep(RENEW_S * 2)
        fresh_at = time.time()
        capp.send_task("tests.e2e.app.sleepy", (0, "fresh-same"), queue=same_q)
        capp.send_task("tests.e2e.app.sleepy", (0, "fresh-other"), queue=other_q)
        time.sleep(max(0.0, began + MIGRATE_S / 2 - time.time()))
        # Half way: some keys are on each side.
        moved_half = _move_keys(source, target, slot, 3)
        time.sleep(max(0.0, began + MIGRATE_S - time.time()))
        before_end = {
            "mig_pend_started": bool(_started(client, prefix, "mig-pend")),
            "fresh_same": _started(client, prefix, "fresh-same"),
            "fresh_other": _started(client, prefix, "fresh-other"),
        }
        moved_rest = _move_keys(source, target, slot, None)
        for node in (target, source, *[n for n in cluster.nodes if n not in (source, target)]):
            node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        migrating = False
        ended = time.time()
        wait_for(lambda: _started(client, prefix, "mig-pend"), 30)
        pend_after_s = _started(client, prefix, "mig-pend")[0] - ended

        results = {q: t.get(timeout=30) for q, t in longs.items()}
        assert [t.get(timeout=30) for t in pending] == ["mig-pend", "mig-due"]
        sampling.set()
        sampler.join(5)
    finally:
        sampling.set()
        if migrating:
            for node in (source, target):
                node.client().execute_command("CLUSTER SETSLOT", slot, "STABLE")
        worker.kill()
    log = worker.text()
    runs = {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}
    masters = _slot_master(cluster)

    def on_master(key: str) -> redis.Redis:
        return masters[key_slot(key.encode())].client()

    dead = {q: on_master(k).zcard(k) for q in longs if (k := f"{prefix}emq:{{{q}}}:dead")}
    stalled = {
        q: int(on_master(k).hget(k, "count") or 0)
        for q in longs
        if (k := f"{prefix}emq:{{{q}}}:metrics:stalled")
    }
    during = [(t, d) for t, d in samples if began - RENEW_S <= t <= ended + RENEW_S]
    renewed = [t for (_, before), (t, d) in itertools.pairwise(during) if d > before]
    gaps = [b - a for a, b in itertools.pairwise([during[0][0], *renewed, during[-1][0]])]
    fresh = {
        tag: round(starts[0] - fresh_at, 2) if starts else None
        for tag, starts in (
            ("same", before_end["fresh_same"]),
            ("other", before_end["fresh_other"]),
        )
    }
    figures = {
        "moved_keys": (moved_half, moved_rest),
        "fresh_delay_s": fresh,
        "pending_started_after_migration_s": round(pend_after_s, 2),
        "pending_started_during_migration": before_end["mig_pend_started"],
        "longest_renewal_gap_same_master_s": round(max(gaps), 2),
        "next_longest_gaps_s": [round(g, 2) for g in sorted(gaps)[-3:-1]],
        "closest_to_lapsing_s": round(min(d - t for t, d in during), 2),
        "runs": runs,
        "dead": dead,
        "stalled": stalled,
        "consumer_restarts": log.count("Connection to broker lost"),
        # Warnings of this transport that name a healthy queue.
        "healthy_warnings": [
            line
            for line in log.splitlines()
            if "WARNING" in line
            and "celery_emq" in line
            and re.search(rf"\b({same_q}|{other_q})\b", line)
        ],
        "warnings": len(re.findall(r"WARNING", log)),
    }
    print(f"\n{figures}")
    # The healthy queues' new tasks start at once, whichever master they are on.
    for tag, delay in fresh.items():
        assert delay is not None and delay < START_WITHIN_S, (tag, figures, log[-3000:])
    # Every task ran once: the migrating queue's long task waited its
    # migration out uncharged, its delayed job ran after it.
    tags = [f"long-{q}" for q in longs] + ["fresh-same", "fresh-other", "mig-pend", "mig-due"]
    assert [runs.get(t) for t in tags] == [1] * len(tags), figures
    assert results == {q: f"long-{q}" for q in longs}
    assert figures["dead"] == dict.fromkeys(longs, 0), figures
    assert figures["stalled"] == dict.fromkeys(longs, 0), figures
    if not figures["pending_started_during_migration"]:
        assert pend_after_s < 5, figures
    # The same master's healthy lease was renewed throughout.
    assert len(during) > MIGRATE_S * 5, len(during)
    assert figures["longest_renewal_gap_same_master_s"] < 2 * RENEW_S + 0.5, figures
    assert figures["closest_to_lapsing_s"] > 0, figures
    assert figures["consumer_restarts"] == 0, (figures, log[-3000:])
    # Only the migrating queue is warned of.
    assert figures["healthy_warnings"] == [], figures


def test_no_script_writes_half_while_its_slot_migrates(cluster: Cluster) -> None:
    """A script whose keys are split between two masters is refused before it runs.

    Redis answers ``ASK``/``TRYAGAIN`` (and ``MOVED``, ``CLUSTERDOWN``) from
    the keys a script declares, before any of it runs: nothing is written on
    either side, and the call fails as the queue's own error.
    """
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
    store = JobStore(client, prefix + "emq", 3000)
    try:
        masters = _slot_master(cluster)
        queue = "q0"
        slot = _slot(prefix, queue)
        source = masters[slot]
        target = next(n for n in cluster.nodes if n is not source)
        for i in range(3):
            store.enqueue(queue, str(i), b"{}")
        [claimed] = store.claim(queue, "me", 1)
        source_id = source.client().execute_command("CLUSTER MYID")
        target_id = target.client().execute_command("CLUSTER MYID")
        target.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        try:
            # Some keys on each side: the pending set moves, the rows stay.
            pending = store.keys(queue).pending
            source.client().execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", pending
            )

            def dump() -> dict[str, dict[bytes, bytes | None]]:
                out = {}
                for node in (source, target):
                    c = node.client(single_connection_client=True)
                    keys = c.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
                    # The target serves its importing slot only after ASKING.
                    out[str(node.port)] = {
                        k: c.execute_command("ASKING") and c.dump(k) for k in keys
                    }
                    c.close()
                return out

            before = dump()
            assert before[str(source.port)] and before[str(target.port)]
            calls = {
                "enqueue": lambda: store.enqueue(queue, "9", b"{}"),
                "claim": lambda: store.claim(queue, "me", 1),
                "extend": lambda: store.extend(queue, [(claimed.id, claimed.token)]),
                "ack": lambda: store.ack(queue, claimed.id, claimed.token),
                "sweep": lambda: store.sweep(queue, 1),
            }
            refused = {}
            for name, call in calls.items():
                with pytest.raises(redis.RedisError) as info:
                    call()
                refused[name] = type(info.value).__name__
            print(f"\n{refused}")
            assert set(refused.values()) <= {"ClusterError", "TryAgainError", "AskError"}
            assert dump() == before
        finally:
            # What moved to the target is dropped; the slot goes back to the source.
            c = target.client(single_connection_client=True)
            for key in c.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000):
                c.execute_command("ASKING")
                c.delete(key)
            c.close()
            for node in (source, target):
                node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", source_id)
    finally:
        for node in cluster.nodes:
            c = node.client()
            for key in c.scan_iter(match=prefix + "*"):
                c.delete(key)
        client.close()
