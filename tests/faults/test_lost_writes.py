"""Lost writes under real workers: a restart from an RDB snapshot, two masters.

A server that persists by RDB snapshots only (Redis's default) and crashes loses
every write since its last snapshot; a replica promoted before it received the
last writes loses them too. These tests take the snapshot (``SAVE``) at the
moment that makes the loss matter, SIGKILL the server and start it again from
the snapshot while ``tests.e2e.app`` workers run, and judge from the ledger on
the suite's Redis (runs, where each ran, results), which the fault cannot touch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from celery_emq.store.jobstore import JobStore
from tests.e2e.app import client_app
from tests.e2e.harness import Worker, wait_for

from .servers import RedisServer, StallingProxy
from .test_outages import explain, runs, settle

pytestmark = pytest.mark.slow

LEASE_MS = 2000
ENV = {"EMQ_E2E_LEASE_MS": str(LEASE_MS), "EMQ_E2E_SWEEP_S": "1", "EMQ_E2E_PREFETCH": "1"}


def started_claims(store: JobStore) -> list[str]:
    """The ids of the jobs whose current claim has started (its start record is in)."""
    ids = [i.decode() for i in store.client.zrange(store.keys("celery").active, 0, -1)]
    rows = {i: store.job("celery", i) for i in ids}
    return [
        i for i, row in rows.items() if "started" in row and row["started"] == row["deliveries"]
    ]


@pytest.mark.parametrize("max_stalled", [0, 1])
def test_a_lost_ack_runs_the_job_at_most_once_more_and_its_success_stands(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
    max_stalled: int,
) -> None:
    broker = redis_server()
    worker = fault_worker(broker, "-c", "1", name="a", EMQ_E2E_MAX_STALLED=str(max_stalled), **ENV)
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    result = capp.send_task("tests.e2e.app.sleepy_here", args=(1.5, "t"))

    # The snapshot holds the started claim; the ack that follows is lost with the crash.
    [job_id] = wait_for(lambda: started_claims(store), 30)
    assert broker.client().save()
    assert result.get(timeout=30) == "t"
    wait_for(lambda: store.job("celery", job_id) == {}, 10)
    broker.restart_from_snapshot()
    assert store.job("celery", job_id)["state"] == "active"  # the ack is gone

    # Back as a started claim nobody holds: it lapses. Within its budget the sweep
    # counts a stall and it runs again; past it, its SUCCESS is found: no stall, no
    # failure counted, only a completion.
    settle(store, timeout=30)
    counted = runs(client, prefix)
    assert counted == {"t": 1 + max_stalled}, explain(client, prefix, ["t"])
    metrics = store.metrics("celery")
    assert (metrics["stalled"], metrics["failed"]) == (max_stalled, 0)
    assert (result.state, result.get(timeout=5)) == ("SUCCESS", "t")
    assert client.hgetall(prefix + "dead-signals") == {}
    if max_stalled == 0:
        # Past its budget, yet it had succeeded: deleted as done, never in the morgue.
        assert "after its task succeeded" in worker.text()
    capp.close()


def acked(writes: list[list[bytes]], rows: bytes) -> list[list[bytes]] | None:
    """``writes``, once one of them deletes a job's row (the ack); else None."""
    return writes if any(w[0] == b"DEL" and w[1].startswith(rows) for w in writes) else None


def test_the_lost_ack_of_a_fast_prefork_task_finds_its_start_on_record(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    """A task done within ``settle_delay_ms``: its start record and its ack leave together.

    The server comes back from its AOF cut just before the ack: it lost the ack
    and every write after it, and kept every write before it.
    """
    broker = redis_server(aof=True)
    worker = fault_worker(
        broker,
        "-P",
        "prefork",
        "-c",
        "1",
        name="a",
        EMQ_E2E_MAX_STALLED="0",
        # Long enough that the ack always finds the start record still queued.
        EMQ_E2E_BROKER_OPTIONS='{"settle_delay_ms": 200}',
        **ENV,
    )
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    result = capp.send_task("tests.e2e.app.sleepy_here", args=(0.0, "t"))
    assert result.get(timeout=30) == "t"
    rows = store.keys("celery").job_prefix.encode()
    # The ack: the job's row deleted (with its message).
    writes = wait_for(lambda: acked(broker.writes(), rows), 10)
    [deleted] = [i for i, w in enumerate(writes) if w[0] == b"DEL" and w[1].startswith(rows)]
    job = writes[deleted][1]
    job_id = job[len(rows) :].decode()
    # Its start record was written too, and before it.
    recorded = [i for i, w in enumerate(writes) if w[:3] == [b"HSET", job, b"started"]]
    assert len(recorded) == 1 and recorded[0] < deleted, (recorded, deleted)

    assert broker.restart_before([b"DEL", job]) > 0
    row = store.job("celery", job_id)
    assert row["state"] == "active", row  # the ack is gone
    assert row["started"] == row["deliveries"], row  # its start is not

    # A started claim nobody holds: past the budget, but the job had succeeded,
    # so it is deleted as done, counted neither stalled nor failed. Not a lapse,
    # not run again.
    settle(store, timeout=30)
    time.sleep(LEASE_MS / 1000)  # a second run, if any, would have started by now
    assert runs(client, prefix) == {"t": 1}, explain(client, prefix, ["t"])
    metrics = store.metrics("celery")
    assert (metrics["stalled"], metrics["failed"], metrics["completed"]) == (0, 0, 1)
    assert (result.state, result.get(timeout=5)) == ("SUCCESS", "t")
    assert client.hgetall(prefix + "dead-signals") == {}
    assert "after its task succeeded" in worker.text()
    capp.close()


def pending_ids(store: JobStore) -> list[str]:
    return [i.decode() for i in store.client.zrange(store.keys("celery").pending, 0, -1)]


def claimed_again(store: JobStore, job_id: str) -> bool:
    return store.job("celery", job_id).get("state") == "active"


def test_a_claim_lost_while_its_worker_runs_it_runs_at_most_twice(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    broker = redis_server()
    capp = client_app(broker.url, prefix, LEASE_MS, ledger=redis_url)
    store = JobStore(broker.client(), prefix + "emq", LEASE_MS)
    # The snapshot holds the job queued and never claimed (its delivery count 0).
    result = capp.send_task("tests.e2e.app.die_on_go", args=(8.0, "t", "a"))
    [job_id] = pending_ids(store)
    assert broker.client().save()

    fault_worker(broker, "-c", "1", name="a", **ENV)
    wait_for(lambda: runs(client, prefix).get("t") == 1, 30)
    fault_worker(broker, "-c", "1", name="b", **ENV)
    # The claim of the run under way on a is lost: the job is queued again, and
    # the next claim of it repeats the lost one's delivery count.
    broker.restart_from_snapshot()
    # The server forgot the claim: the job is queued again, unless a worker
    # already reconnected and claimed it anew, under the same delivery count.
    row = store.job("celery", job_id)
    assert row["state"] in ("pending", "active") and int(row.get("deliveries", 0)) <= 1, row
    wait_for(lambda: claimed_again(store, job_id), 30)
    time.sleep(0.5)
    # The first run ends the way a killed worker's does: its worker charges its
    # claim a stall. That claim is gone; the live one is the re-run's (long
    # enough to be live still when the worker notices its pool process died).
    client.set(prefix + "go:t", 1)

    assert result.get(timeout=30) == "t"
    settle(store, timeout=20)
    time.sleep(LEASE_MS / 1000)  # a third run, if any, would have started by now
    assert runs(client, prefix) == {"t": 2}, explain(client, prefix, ["t"])
    assert result.state == "SUCCESS"
    assert client.hgetall(prefix + "dead-signals") == {}
    assert store.metrics("celery")["failed"] == 0
    # The killed run's charge named the lost claim: fenced, counted, nothing changed.
    assert store.fenced("celery").get("charge") == 1, store.fenced("celery")
    capp.close()


def replicated(replica: redis.Redis) -> bool:
    info = replica.info("replication")
    return bool(info.get("master_link_status") == "up")


def test_two_masters_run_a_job_once_each_and_settle_only_their_own_claim(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    old = redis_server()
    new = redis_server("--replicaof", "127.0.0.1", str(old.port))
    wait_for(lambda: replicated(new.client()), 20)
    capp = client_app(old.url, prefix, LEASE_MS, ledger=redis_url)
    stores = {s: JobStore(s.client(), prefix + "emq", LEASE_MS) for s in (old, new)}
    result = capp.send_task("tests.e2e.app.die_on_go", args=(8.0, "t", "a"))
    [job_id] = pending_ids(stores[old])
    wait_for(lambda: stores[new].job("celery", job_id), 10)
    # The replica is made master while the old master still takes writes.
    new.client().replicaof("NO", "ONE")

    proxy = StallingProxy(old.port)
    try:
        fault_worker(old, "-c", "1", name="a", EMQ_E2E_REDIS=proxy.url, **ENV)
        wait_for(lambda: runs(client, prefix).get("t") == 1, 30)
        # Each master hands out the job: both claims carry delivery count 1.
        fault_worker(new, "-c", "1", name="b", **ENV)
        wait_for(lambda: runs(client, prefix).get("t") == 2, 30)
        assert stores[old].job("celery", job_id)["deliveries"] == "1"
        assert stores[new].job("celery", job_id)["deliveries"] == "1"
        # a's connections move to the new master, where b's claim of the job runs.
        assert proxy.retarget(new.port) > 0
        wait_for(lambda: proxy.connections >= 2, 20)
        time.sleep(1.5)
        # a's run ends as a killed worker's does: a charges its claim a stall,
        # a claim the new master never gave it.
        client.set(prefix + "go:t", 1)

        assert result.get(timeout=30) == "t"
        settle(stores[new], timeout=20)
        time.sleep(LEASE_MS / 1000)  # a third run, if any, would have started by now
    finally:
        proxy.close()
    # One run per master (two masters can both hand out a job), never a third.
    assert runs(client, prefix) == {"t": 2}, explain(client, prefix, ["t"])
    assert result.state == "SUCCESS"
    assert client.hgetall(prefix + "dead-signals") == {}
    assert stores[new].metrics("celery")["failed"] == 0
    # a's charge named a claim the new master never gave: fenced, nothing changed.
    assert stores[new].fenced("celery").get("charge") == 1, stores[new].fenced("celery")
    capp.close()
