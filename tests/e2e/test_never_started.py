"""End to end: a message that kills the whole worker before its task starts.

Its decoder kills the worker's main process as Celery receives it, before any
``task_prerun``: no start is recorded, so no stall is ever counted. Its lapses
are counted instead, and bounded (``max_lapsed``); a worker holds one such suspect
at a time and dies of it alone: the blame is its, the innocents around it run once
each.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError
from celery_emq.store.codec import unpack
from celery_emq.store.jobstore import JobStore

from .app import DOOM
from .harness import Worker, run_celery, wait_for

pytestmark = pytest.mark.slow

#: The exit code of a worker the doomed serializer killed.
KILLED = 86


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def test_a_message_that_kills_a_prefork_worker_before_it_starts_reaches_the_morgue(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
) -> None:
    env = {
        "EMQ_E2E_LEASE_MS": "2000",
        "EMQ_E2E_SWEEP_S": "0.5",
        "EMQ_E2E_MAX_STALLED": "1",
        "EMQ_E2E_MAX_LAPSED": "2",
        "EMQ_E2E_PREFETCH": "4",
        "EMQ_E2E_ACCEPT_DOOMED": "1",
    }
    store = JobStore(client, prefix + "emq", 2000)
    w = start_worker("-P", "prefork", "-c", "2", name="pf0", **env)
    # A long task runs in one pool process when the doomed message arrives.
    long = capp.send_task("tests.e2e.app.sleepy", args=(3, "long"))
    wait_for(lambda: runs(client, prefix).get("long") == 1, 15)
    # Its start is recorded (the worker sends it within settle_delay_ms): stopped
    # before, the worker could die with the record unsent, and the long task's
    # lapse would count as one before a start, not as the stall asserted below.
    long_job = _job_id(store, long.id)
    wait_for(lambda: store.job("celery", long_job).get("started"), 5)
    # The worker's main process is stopped while the six are published, so that
    # its next claim takes them in one batch: it hands the two before the doomed
    # one to the pool and dies on the doomed one in the same turn of its event
    # loop, before any of them reaches a pool process. Published while it runs,
    # an innocent could be claimed on its own and run in the free pool process,
    # and the doomed message, unknown yet, kill the worker before it heard the
    # result: that innocent would run again, whatever the transport does.
    os.kill(w.proc.pid, signal.SIGSTOP)
    try:
        before = [capp.send_task("tests.e2e.app.sleepy", args=(0, f"b{i}")) for i in range(2)]
        doomed = capp.send_task("tests.e2e.app.sleepy", args=(0, DOOM), serializer="doomed")
        after = [capp.send_task("tests.e2e.app.sleepy", args=(0, f"a{i}")) for i in range(3)]
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)

    def settled() -> bool:
        counts = store.counts("celery")
        return counts["pending"] == 0 and counts["active"] == 0

    exits: list[int | None] = []
    deadline = time.monotonic() + 90
    while len(exits) < 6 and time.monotonic() < deadline:
        if exits:
            w = start_worker("-P", "prefork", "-c", "2", name=f"pf{len(exits)}", **env)
        wait_for(
            lambda w=w: w.proc.poll() is not None or settled(),
            max(0.1, deadline - time.monotonic()),
        )
        exits.append(w.proc.poll())
        if exits[-1] is None:
            break
        w.kill()  # its orphaned pool processes too
    # One kill in its first batch, then one each time it is claimed as a suspect,
    # until its third lapse (max_lapsed=2) sends it to the morgue; then the worker lives.
    assert exits == [KILLED, KILLED, KILLED, None]
    assert [r.get(timeout=15) for r in [long, *before, *after]] == [
        "long",
        "b0",
        "b1",
        "a0",
        "a1",
        "a2",
    ]
    # The long task, running at the first kill (no suspect held then), was
    # charged that stall and ran again. After that, a worker takes the doomed
    # message, a suspect since, beside whatever it runs: a task running when it
    # kills the worker runs again (once for each kill it was running at), charged
    # nothing (the metrics below). The innocents published with it ran, at most once
    # more each.
    counted = runs(client, prefix)
    assert 2 <= counted.pop("long") <= 1 + exits.count(KILLED)
    assert set(counted) == {"b0", "b1", "a0", "a1", "a2"}
    assert all(n in (1, 2) for n in counted.values()), counted
    with pytest.raises(StalledJobError, match=r"before it started \(never_started\)"):
        doomed.get(timeout=10)
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}, 10
    )
    row = store.job("celery", _job_id(store, doomed.id))
    assert (row["state"], row["reason"], row["stalled"], row["lapsed"]) == (
        "dead",
        "never_started",
        "0",
        "3",
    )
    assert {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()} == {
        f"tests.e2e.app.sleepy:{doomed.id}:never_started": 1
    }
    assert store.metrics("celery") == {
        "completed": 6,
        "recovered": 1,
        "stalled": 1,
        "failed": 1,
        "retried": 0,
    }
    # The worker keeps consuming.
    assert capp.send_task("tests.e2e.app.sleepy", args=(0, "later")).get(timeout=15) == "later"
    # Describing it decodes nothing, even where the serializer is accepted.
    shown = run_celery({**e2e_env, **env}, "emq", "dead", "show", doomed.id, "--json")
    assert shown.returncode == 0, shown.stderr
    job = json.loads(shown.stdout)
    assert (job["task_name"], job["args"], job["reason"]) == (
        "tests.e2e.app.sleepy",
        None,
        "never_started",
    )
    assert job["decode_error"].startswith("application/x-emq-doomed, ")


def _job_id(store: JobStore, task_id: str) -> str:
    """The job id of the message that carries ``task_id`` (pending, active or dead)."""
    k = store.keys("celery")
    for key in (k.pending, k.active, k.dead):
        for raw in store.client.zrange(key, 0, -1):
            job_id = raw.decode()
            row = store.job("celery", job_id)
            message = store.client.get(k.msg(job_id)) or row.get("payload", "")
            if task_id.encode() in unpack(message):
                return job_id
    raise AssertionError(f"no job carries task {task_id}")
