"""End to end: countdown/ETA tasks wait in the broker, not in the worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from celery_emq.store.jobstore import JobStore
from celery_emq.store.status import queue_status

from .harness import Worker, suite_app, wait_for

pytestmark = pytest.mark.slow


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def started(client: redis.Redis, prefix: str, tag: str) -> list[float]:
    return [float(t) for t in client.lrange(prefix + "started:" + tag, 0, -1)]


def test_eta_tasks_wait_in_the_broker_and_each_runs_once_on_time(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    start_worker("-c", "2", "-P", "prefork")
    store = JobStore(client, prefix + "emq", 30000)
    n = 20
    etas = {}
    with capp.producer_or_acquire() as producer:
        for i in range(n):
            eta = datetime.fromtimestamp(time.time() + 4 + i * 0.1, tz=timezone.utc)
            etas[f"d{i}"] = eta.timestamp()
            capp.send_task("tests.e2e.app.sleepy", args=(0, f"d{i}"), eta=eta, producer=producer)
    # Held by the broker, not by the worker: nothing is leased, all are delayed.
    status = queue_status(store, "celery")
    assert (status["delayed"], status["active"], status["pending"]) == (n, 0, 0)
    wait_for(lambda: client.llen(prefix + "done") == n, timeout=30, interval=0.2)
    assert runs(client, prefix) == {tag: 1 for tag in etas}
    late = {tag: started(client, prefix, tag)[0] - eta for tag, eta in etas.items()}
    # Not before its ETA, and within about a second after it.
    assert min(late.values()) >= 0
    assert max(late.values()) < 1.5, late
    wait_for(lambda: store.counts("celery")["active"] == 0, 10)
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def test_a_delayed_task_survives_a_killed_worker(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    w = start_worker("-c", "1", name="first")
    result = capp.send_task("tests.e2e.app.sleepy", args=(0, "later"), countdown=5)
    store = JobStore(client, prefix + "emq", 30000)
    assert store.counts("celery")["delayed"] == 1
    w.kill()
    start_worker("-c", "1", name="second")
    assert result.get(timeout=30) == "later"
    assert runs(client, prefix) == {"later": 1}


def test_revoke_before_the_eta_discards_the_task(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    capp = suite_app(redis_url, prefix)
    start_worker("-c", "1")
    store = JobStore(client, prefix + "emq", 30000)
    doomed = capp.send_task("tests.e2e.app.sleepy", args=(0, "doomed"), countdown=3600)
    kept = capp.send_task("tests.e2e.app.sleepy", args=(0, "kept"), countdown=3)
    assert store.counts("celery")["delayed"] == 2
    capp.control.revoke(doomed.id)
    # Out of the delayed set at once, discarded by the worker as revoked.
    wait_for(lambda: AsyncResult(doomed.id, app=capp).state == "REVOKED", 15)
    assert kept.get(timeout=20) == "kept"
    assert runs(client, prefix) == {"kept": 1}
    wait_for(lambda: store.counts("celery")["active"] == 0, 10)
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    capp.close()


def test_a_worker_that_never_heard_the_revoke_still_discards_the_task(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    # The revoke reached a worker that died before claiming the job (or a worker
    # that has forgotten it, hours later): the mark on the job decides.
    from celery_emq.worker.state import promote_revoked

    capp = suite_app(redis_url, prefix)
    doomed = capp.send_task("tests.e2e.app.sleepy", args=(0, "doomed"), countdown=3600)
    capp.send_task("tests.e2e.app.sleepy", args=(0, "kept"))
    store = JobStore(client, prefix + "emq", 30000)
    store.register("celery")
    assert promote_revoked(capp, [doomed.id]) == 1
    start_worker("-c", "1")
    wait_for(lambda: runs(client, prefix).get("kept") == 1, 20)
    wait_for(lambda: AsyncResult(doomed.id, app=capp).state == "REVOKED", 15)
    assert runs(client, prefix) == {"kept": 1}
    capp.close()


def test_a_task_due_before_any_other_starts_on_time_though_the_worker_waits_long(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    # An idle worker's wait lasts until the earliest delayed job it knows of is
    # due, or idle_wait_s (8 s): a job published during that wait, due sooner
    # than any before, must wake it (the sweep, 9 s apart here, is not what runs it).
    start_worker("-c", "1", "-P", "prefork", EMQ_E2E_SWEEP_S="9")
    store = JobStore(client, prefix + "emq", 30000)
    capp.send_task("tests.e2e.app.sleepy", args=(0, "far"), countdown=600)
    time.sleep(2.5)  # the worker waits long now
    etas = {}
    for tag, ahead_s in (("near", 4.0), ("nearer", 1.5)):
        eta = datetime.fromtimestamp(time.time() + ahead_s, tz=timezone.utc)
        etas[tag] = eta.timestamp()
        capp.send_task("tests.e2e.app.sleepy", args=(0, tag), eta=eta)
        time.sleep(0.5)
    wait_for(lambda: client.llen(prefix + "done") == 2, timeout=20, interval=0.1)
    late = {tag: started(client, prefix, tag)[0] - eta for tag, eta in etas.items()}
    assert min(late.values()) >= 0
    assert max(late.values()) < 1.0, late
    assert runs(client, prefix) == {"near": 1, "nearer": 1}
    assert store.counts("celery")["delayed"] == 1
