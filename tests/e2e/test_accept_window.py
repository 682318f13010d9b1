"""End to end: deliveries a threads worker was handed but never started.

Celery's threads pool queues each task it is handed in its executor; the task
is accepted when a thread picks it up. A warm shutdown cancels what is still
queued (Celery 5.5+): those tasks never run, so their claims go back at once,
uncounted, like every other unstarted delivery of a warm shutdown.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq.store.jobstore import JobStore

from .harness import Worker, wait_for

pytestmark = pytest.mark.slow

LEASE_MS = 30_000


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def test_a_warm_shutdown_gives_back_what_the_threads_pool_never_started(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    env = {"EMQ_E2E_LEASE_MS": str(LEASE_MS), "EMQ_E2E_PREFETCH": "4"}
    store = JobStore(client, prefix + "emq", LEASE_MS)
    w = start_worker("-P", "threads", "-c", "1", name="t", **env)
    capp.send_task("tests.e2e.app.sleepy", args=(1.5, "long"))
    wait_for(lambda: runs(client, prefix).get("long") == 1, 30)
    queued = [capp.send_task("tests.e2e.app.sleepy", args=(0, f"q{i}")) for i in range(3)]
    # Claimed and handed to the pool's executor, behind the running task.
    wait_for(lambda: store.counts("celery")["active"] == 4, 10)
    time.sleep(0.3)
    assert w.warm_stop() == 0
    # Celery 5.4 runs them before it stops; later versions cancel them. Those
    # it did not run are back in line at once, not held until their leases
    # lapse, and nothing is counted against them.
    ran = {t: n for t, n in runs(client, prefix).items() if t != "long"}
    assert set(ran.values()) <= {1}
    assert store.counts("celery") == {
        "pending": 3 - len(ran),
        "active": 0,
        "delayed": 0,
        "dead": 0,
    }
    for job_id in (j.decode() for j in client.zrange(store.keys("celery").pending, 0, -1)):
        row = store.job("celery", job_id)
        assert (row["state"], row["stalled"], row.get("lapsed")) == ("pending", "0", None)
    start_worker("-P", "threads", "-c", "1", name="s", **env)
    assert [r.get(timeout=15) for r in queued] == ["q0", "q1", "q2"]
    assert runs(client, prefix) == {"long": 1, "q0": 1, "q1": 1, "q2": 1}
