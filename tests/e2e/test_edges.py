"""End to end at the edges: a frozen worker, a poison that kills a solo worker,
a pickle a JSON-only worker refuses, and the queue registry under remote control.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError
from celery_emq.store.jobstore import JobStore

from . import app as e2e_app
from .app import note_unpickled
from .harness import Worker, run_celery, suite_app, wait_for

pytestmark = pytest.mark.slow

QUIET = {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def texts(client: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in client.lrange(key, 0, -1)]


def dead_signals(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()}


def test_a_stopped_worker_is_fenced_after_its_job_ran_again_elsewhere(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    lease_ms = 2000
    env = {"EMQ_E2E_LEASE_MS": str(lease_ms), "EMQ_E2E_SWEEP_S": "0.5"}
    capp = suite_app(redis_url, prefix, lease_ms)
    store = JobStore(client, prefix + "emq", lease_ms)
    k = store.keys("celery")
    workers = {w.name: w for w in (start_worker("-c", "1", name=n, **env) for n in ("a", "b"))}
    result = capp.send_task("tests.e2e.app.sleepy_here", args=(6, "s"))
    wait_for(lambda: client.llen(prefix + "ran-on:s") == 1, 15)
    [first_node] = texts(client, prefix + "ran-on:s")
    stopped = workers[first_node.split("@")[0]]
    [survivor] = [w for w in workers.values() if w is not stopped]
    [job_id] = [j.decode() for j in client.zrange(k.active, 0, -1)]
    assert store.job("celery", job_id)["deliveries"] == "1"

    # Freeze the worker and its pool process together: no renewal, no progress,
    # but the task has started, so the lapse is a stall the survivor recovers.
    frozen_for = 2 * lease_ms / 1000 + 1
    os.killpg(stopped.proc.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: client.llen(prefix + "ran-on:s") == 2, 10)
        time.sleep(max(0.0, stopped_at + frozen_for - time.monotonic()))
        row = store.job("celery", job_id)
        assert (row["state"], row["deliveries"], row["stalled"]) == ("active", "2", "1")
    finally:
        os.killpg(stopped.proc.pid, signal.SIGCONT)

    # The stopped run's sleep ends on its original (monotonic) deadline, about a
    # second after it resumes; the survivor's run holds the job until seconds later.
    wait_for(lambda: client.llen(prefix + "done") == 2, 20)
    names = [stopped.name, survivor.name]
    assert [n.split("@")[0] for n in texts(client, prefix + "ran-on:s")] == names
    assert [n.split("@")[0] for n in texts(client, prefix + "done-on:s")] == names
    assert texts(client, prefix + "done") == ["s", "s"]
    assert result.get(timeout=10) == "s"
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    assert client.zcard(k.dead) == 0
    assert store.job("celery", job_id) == {}
    # The fenced ack completes nothing: only the survivor's ack is counted.
    assert store.metrics("celery") == {
        "completed": 1,
        "recovered": 1,
        "stalled": 1,
        "failed": 0,
        "retried": 0,
    }
    left = "fenced: another claim holds the job now; left to it, marked completed"
    fenced = re.compile(
        rf"celery_emq: ack of {job_id} in celery \(claim 1\.[0-9a-f]{{16}}\): {left}"
    )
    wait_for(lambda: fenced.search(stopped.text()), 5)
    assert store.fenced("celery")["ack"] == 1
    # The survivor's claim was never disturbed: it renewed and acked it.
    assert "ack of" not in survivor.text() and "were lost" not in survivor.text()
    recovered = f"sleepy_here[{result.id}] recovered to celery (stall 1, lease_expired)"
    assert recovered in survivor.text()
    time.sleep(3)  # nothing may run it a third time
    assert runs(client, prefix) == {"s": 2}
    assert store.counts("celery") == QUIET
    capp.close()


def test_a_poison_that_kills_a_solo_worker_spares_its_prefetched_neighbours(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    env = {
        "EMQ_E2E_LEASE_MS": "2000",
        "EMQ_E2E_SWEEP_S": "0.5",
        "EMQ_E2E_MAX_STALLED": "1",
        "EMQ_E2E_PREFETCH": "4",
    }
    store = JobStore(client, prefix + "emq", 2000)
    # Published before any worker runs, so the first one claims all four in one
    # batch: the innocents are prefetched by the process the poison kills.
    poisoned = capp.send_task("tests.e2e.app.poison", args=("p",))
    innocents = [capp.send_task("tests.e2e.app.sleepy", args=(0, f"i{i}")) for i in range(3)]

    def settled() -> bool:
        counts = store.counts("celery")
        return counts["pending"] == 0 and counts["active"] == 0

    exits: list[int | None] = []
    deadline = time.monotonic() + 60
    while len(exits) < 8 and time.monotonic() < deadline:
        w = start_worker("-P", "solo", name=f"solo{len(exits)}", ready=False, **env)
        wait_for(
            lambda w=w: w.proc.poll() is not None or settled(),
            max(0.1, deadline - time.monotonic()),
        )
        exits.append(w.proc.poll())
        if exits[-1] is None:
            break
    # The poison kills the first two workers (its first run and its one
    # forgiven stall); the third finds it dead-lettered and runs the rest.
    assert exits == [-signal.SIGKILL, -signal.SIGKILL, None]
    assert runs(client, prefix) == {"p": 2, "i0": 1, "i1": 1, "i2": 1}
    assert [int(x) for x in client.lrange(prefix + "stall-header:p", 0, -1)] == [0, 1]
    assert [r.get(timeout=10) for r in innocents] == ["i0", "i1", "i2"]
    with pytest.raises(StalledJobError, match=r"stalled 2 times \(lease_expired\)"):
        poisoned.get(timeout=10)
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}, 10
    )
    [dead_id] = [j.decode() for j in client.zrange(store.keys("celery").dead, 0, -1)]
    row = store.job("celery", dead_id)
    headers = json.loads(row["payload"])["headers"]
    assert (headers["task"], headers["id"]) == ("tests.e2e.app.poison", poisoned.id)
    # A solo worker dies with its task: no parent reports the loss, so it is the
    # lapsed lease the next worker's sweep counts.
    assert (row["state"], row["stalled"], row["last_error"], row["reason"]) == (
        "dead",
        "2",
        "stalled",
        "lease_expired",
    )
    assert dead_signals(client, prefix) == {f"tests.e2e.app.poison:{poisoned.id}:lease_expired": 1}
    # The innocents were claimed twice and never charged: only the poison stalled.
    assert store.metrics("celery") == {
        "completed": 3,
        "recovered": 1,
        "stalled": 2,
        "failed": 1,
        "retried": 0,
    }


class Tripwire:
    """Pickles as a call to ``note_unpickled``: loading it leaves a key behind."""

    def __init__(self, prefix: str, tag: str) -> None:
        self.prefix = prefix
        self.tag = tag

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return note_unpickled, (self.prefix, self.tag)


def test_a_pickle_a_json_worker_refuses_is_dead_lettered_and_never_loaded(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_worker("-c", "1")
    store = JobStore(client, prefix + "emq", 30000)
    k = store.keys("celery")
    tripped = prefix + "unpickled:t"

    def unpickled_by() -> list[str]:
        return texts(client, tripped)

    pickled = capp.send_task(
        "tests.e2e.app.sleepy", args=(0, Tripwire(prefix, "t")), serializer="pickle"
    )
    after = capp.send_task("tests.e2e.app.sleepy", args=(0, "after"))
    assert after.get(timeout=20) == "after"
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}, 10
    )
    [dead_id] = [j.decode() for j in client.zrange(k.dead, 0, -1)]
    row = store.job("celery", dead_id)
    refused = (
        "ContentDisallowed: the consumer does not accept content of type "
        "application/x-python-serialize (accept_content: application/json); "
        "the body was not decoded"
    )
    assert (row["state"], row["reason"], row["last_error"], row["error"]) == (
        "dead",
        "content_disallowed",
        "content_disallowed",
        refused,
    )
    assert runs(client, prefix) == {"after": 1}
    assert dead_signals(client, prefix) == {
        f"tests.e2e.app.sleepy:{pickled.id}:content_disallowed": 1
    }
    assert unpickled_by() == []

    swept = run_celery(e2e_env, "emq", "sweep", "--json")
    assert swept.returncode == 0, swept.stderr
    assert json.loads(swept.stdout)["queues"] == [
        {
            "queue": "celery",
            "recovered": [],
            "dead": [],
            "reaped": [],
            "requeued": [],
            "completed": [],
            "graced": [],
            "trimmed": 0,
        }
    ]
    assert unpickled_by() == []

    listed = run_celery(e2e_env, "emq", "dead", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    [job] = json.loads(listed.stdout)["jobs"]
    assert unpickled_by() == []
    shown = run_celery(e2e_env, "emq", "dead", "show", dead_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == job
    assert unpickled_by() == []
    assert (job["id"], job["task_name"], job["task_id"], job["reason"], job["error"]) == (
        dead_id,
        "tests.e2e.app.sleepy",
        pickled.id,
        "content_disallowed",
        refused,
    )
    assert (job["args"], job["kwargs"], job["stalled"], job["deliveries"], job["history"]) == (
        None,
        None,
        0,
        1,
        [],
    )
    assert job["decode_error"].startswith("ContentDisallowed: ")
    assert "application/x-python-serialize" in job["decode_error"]
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}

    # The tripwire works: loading the stored body (here, in this process) marks it.
    monkeypatch.setattr(e2e_app, "_r", client)
    message = json.loads(row["payload"])
    assert message["content-type"] == "application/x-python-serialize"
    args, _kwargs, _embed = pickle.loads(base64.b64decode(message["body"]))
    assert args == (0, "t")
    assert len(unpickled_by()) == 1


def test_remote_control_replies_do_not_enter_the_queue_registry(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
) -> None:
    worker = start_worker("-c", "1")
    # Naming the destination makes each ping return on its one reply.
    node = f"{worker.name}@{socket.gethostname()}"
    args = ("inspect", "ping", "-d", node, "--timeout", "10")
    with ThreadPoolExecutor(max_workers=4) as pool:
        pings = list(pool.map(lambda _: run_celery(e2e_env, *args, timeout=60), range(20)))
    for ping in pings:
        assert ping.returncode == 0, ping.stderr
        assert f"{node}: OK" in ping.stdout and "pong" in ping.stdout
    assert capp.send_task("tests.e2e.app.add", args=(2, 3)).get(timeout=20) == 5
    store = JobStore(client, prefix + "emq", 30000)
    wait_for(lambda: store.counts("celery") == QUIET, 10)
    status = run_celery(e2e_env, "emq", "status", "--json")
    assert status.returncode == 0, status.stderr
    queues = [q["queue"] for q in json.loads(status.stdout)["queues"]]
    assert queues == ["celery"]
    assert client.smembers(store.registry_key) == {b"celery"}
    assert not [q for q in queues if q.endswith(".reply.celery.pidbox")]
