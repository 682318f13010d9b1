"""The Celery app the end-to-end tests run under real ``celery worker`` processes.

Configured from the environment so each test gets its own key prefix and lease:
``EMQ_E2E_REDIS`` (a ``redis://`` URL), ``EMQ_E2E_PREFIX``, ``EMQ_E2E_LEASE_MS``;
``EMQ_E2E_BROKER`` (default: ``EMQ_E2E_REDIS`` through ``emq://``) and
``EMQ_E2E_BROKER_OPTIONS`` (JSON transport options it needs) name the broker
when it is reached another way (``emq+sentinel://``); ``EMQ_E2E_BROKER_SSL``
(JSON) is its ``broker_use_ssl``.
Tasks record every run in Redis under the prefix so tests can count them: in the
broker's Redis, or in ``EMQ_E2E_LEDGER`` (which also holds the results) when a
fault test takes the broker's Redis down.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import redis
from celery import Celery
from kombu.serialization import register as register_serializer

import celery_emq
from celery_emq.signals import job_dead_lettered
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.jobs import JobInfo
from celery_emq.worker.state import request_claim

REDIS = os.environ.get("EMQ_E2E_REDIS", "redis://127.0.0.1:6379/11")
PREFIX = os.environ.get("EMQ_E2E_PREFIX", "e2e:")
LEASE_MS = int(os.environ.get("EMQ_E2E_LEASE_MS", "30000"))
LEDGER = os.environ.get("EMQ_E2E_LEDGER") or REDIS
BROKER = os.environ.get("EMQ_E2E_BROKER") or None
BROKER_OPTIONS: dict[str, Any] = json.loads(os.environ.get("EMQ_E2E_BROKER_OPTIONS") or "{}")
BROKER_SSL: dict[str, Any] | None = json.loads(os.environ.get("EMQ_E2E_BROKER_SSL") or "null")


def make_conf(
    redis_url: str,
    prefix: str,
    lease_ms: int,
    ledger: str | None = None,
    broker: str | None = None,
    broker_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the Celery settings shared by the workers and the test's client."""
    return {
        "broker_url": broker or redis_url.replace("redis://", "emq://", 1),
        "result_backend": ledger or redis_url,
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "broker_transport_options": {
            **(broker_options or {}),
            "global_keyprefix": prefix,
            "lease_ms": lease_ms,
            "client_name": os.environ.get("EMQ_E2E_CLIENT_NAME", "emq-e2e"),
            "sweep_interval_s": float(os.environ.get("EMQ_E2E_SWEEP_S", "5")),
            "max_stalled": int(os.environ.get("EMQ_E2E_MAX_STALLED", "1")),
            **(
                {"max_lapsed": int(os.environ["EMQ_E2E_MAX_LAPSED"])}
                if os.environ.get("EMQ_E2E_MAX_LAPSED")
                else {}
            ),
        },
        "broker_connection_retry_on_startup": True,
        "task_acks_late": os.environ.get("EMQ_E2E_ACKS_LATE", "1") == "1",
        "worker_prefetch_multiplier": int(os.environ.get("EMQ_E2E_PREFETCH", "4")),
        "result_expires": 600,
        "worker_hijack_root_logger": False,
    }


def client_app(
    redis_url: str,
    prefix: str,
    lease_ms: int = 30000,
    ledger: str | None = None,
    broker: str | None = None,
    broker_options: dict[str, Any] | None = None,
) -> Celery:
    """A Celery app for the test process, sending to the same queues."""
    c = Celery("e2e-client", set_as_current=False)
    c.conf.update(make_conf(redis_url, prefix, lease_ms, ledger, broker, broker_options))
    return c


#: A body holding this marker kills the process that decodes it (serializer ``doomed``).
DOOM = "DOOM"


def _doomed_loads(body: Any) -> Any:
    """Decode JSON, but die at once (no cleanup, no exception) on a marked body.

    Stands for a decoder that crashes the process: a C extension, an
    out-of-memory kill while decoding. Celery's worker decodes a task's body in
    its main process when it receives it, before any ``task_prerun``.
    """
    text = body.decode() if isinstance(body, bytes) else body
    if DOOM in text:
        os._exit(86)
    return json.loads(text)


register_serializer("doomed", json.dumps, _doomed_loads, "application/x-emq-doomed", "utf-8")

app = Celery("e2e")
app.conf.update(make_conf(REDIS, PREFIX, LEASE_MS, LEDGER, BROKER, BROKER_OPTIONS))
if os.environ.get("EMQ_E2E_ACCEPT_DOOMED") == "1":
    app.conf.accept_content = ["json", "doomed"]
if BROKER_SSL is not None:
    app.conf.broker_use_ssl = BROKER_SSL
if os.environ.get("EMQ_E2E_BEAT_S"):
    celery_emq.schedule_sweep(app, every_s=float(os.environ["EMQ_E2E_BEAT_S"]))

_r: redis.Redis | None = None


def rec() -> redis.Redis:
    global _r
    if _r is None:
        if os.environ.get("EMQ_TEST_CLUSTER") == "1" and not os.environ.get("EMQ_E2E_LEDGER"):
            # The tests read the ledger with the client that reads the broker's keys.
            from tests.conftest import broker_client

            _r = broker_client()
        else:
            _r = redis.Redis.from_url(LEDGER)
    return _r


def note_run(tag: str) -> int:
    """Count one run of ``tag`` and remember when it started."""
    pipe = rec().pipeline()
    pipe.hincrby(PREFIX + "runs", tag, 1)
    pipe.rpush(PREFIX + "started:" + tag, repr(time.time()))
    return int(pipe.execute()[0])


@app.task(ignore_result=True)
def record(i: int) -> None:
    rec().hincrby(PREFIX + "runs", str(i), 1)


@app.task(ignore_result=True)
def ledger(i: int) -> None:
    """Append ``<i> <time run>`` to ``<prefix>ledger`` (the failover test counts runs)."""
    rec().rpush(PREFIX + "ledger", f"{i} {time.time()!r}")


@app.task
def sleepy(seconds: float, tag: str) -> str:
    note_run(tag)
    time.sleep(seconds)
    rec().rpush(PREFIX + "done", tag)
    return tag


@app.task
def spin(seconds: float, tag: str) -> str:
    """Burn CPU in pure Python (no sleep, no I/O) for ``seconds``."""
    note_run(tag)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += sum(i * i for i in range(1000))
    rec().rpush(PREFIX + "done", tag)
    return tag


@app.task(bind=True)
def sleepy_here(self: Any, seconds: float, tag: str) -> str:
    """Like ``sleepy``, also recording which worker started and finished each run.

    Node names go to ``<prefix>ran-on:<tag>`` when a run starts and to
    ``<prefix>done-on:<tag>`` when it finishes.
    """
    return _run_here(self, seconds, tag)


def _run_here(self: Any, seconds: float, tag: str, hold: Any = None) -> str:
    """``sleepy_here``'s body; ``hold()``, if given, runs once the start is noted."""
    note_run(tag)
    rec().rpush(PREFIX + "ran-on:" + tag, self.request.hostname)
    if hold is not None:
        hold()
    time.sleep(seconds)
    pipe = rec().pipeline()
    pipe.rpush(PREFIX + "done", tag)
    pipe.rpush(PREFIX + "done-on:" + tag, self.request.hostname)
    pipe.execute()
    return tag


@app.task(bind=True)
def die_on_go(self: Any, seconds: float, tag: str, victim: str) -> str:
    """Run like ``sleepy_here``, except the first run on worker ``victim``.

    That run waits (30 s at most) for ``<prefix>go:<tag>`` to exist, then kills
    its pool process: the worker loses it and charges its claim a stall.
    """

    def hold() -> None:
        if self.request.hostname.split("@")[0] != victim:
            return
        if rec().incr(PREFIX + "victim-runs:" + tag) == 1:
            deadline = time.monotonic() + 30
            while not rec().exists(PREFIX + "go:" + tag) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    return _run_here(self, seconds, tag, hold)


@app.task(bind=True)
def claim_of(self: Any) -> dict[str, Any]:
    """Return the claim this run was delivered under, as the task reads it, with its row.

    The row's ``claim`` is the live claim id, and ``started`` the claim whose
    start was recorded (by the worker's main process under prefork: waited for).
    """
    claim = request_claim(self.request)
    row: dict[str, str] = {}
    if claim is not None:
        store = JobStore(rec(), PREFIX + "emq", LEASE_MS)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            row = store.job("celery", claim[0])
            if row.get("started"):
                break
            time.sleep(0.05)
    return {
        "claim": list(claim) if claim else None,
        "pid": os.getpid(),
        "emq_claim": getattr(self.request, "emq_claim", None),
        "row": {k: row.get(k) for k in ("claim", "started", "deliveries")},
    }


def note_unpickled(prefix: str, tag: str) -> str:
    """Append the loading process's command line to ``<prefix>unpickled:<tag>``.

    A pickle naming this function calls it when loaded. The key prefix is an
    argument, not this module's ``PREFIX``, so the mark lands under the test's
    prefix in whichever process unpickles it, and says which process that was.
    """
    rec().rpush(prefix + "unpickled:" + tag, f"{os.getpid()} {' '.join(sys.argv)}")
    return tag


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def tsum(values: list[int]) -> int:
    return sum(values)


@app.task(bind=True, max_retries=5, default_retry_delay=0.2)
def flaky(self: Any, tag: str, fail_times: int) -> int:
    n = note_run(tag)
    if n <= fail_times:
        raise self.retry(countdown=0.2)
    return n


def _kill_own_process(self: Any, tag: str) -> None:
    rec().rpush(PREFIX + "stall-header:" + tag, str(getattr(self.request, "emq_stalled", 0)))
    claim = request_claim(self.request)
    rec().rpush(PREFIX + "claims:" + tag, f"{claim[1] if claim else '-'} {os.getpid()}")
    note_run(tag)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(bind=True)
def poison(self: Any, tag: str) -> None:
    """Kill the pool process running it, every run."""
    _kill_own_process(self, tag)


@app.task(bind=True, emq_max_stalled=3)
def poison3(self: Any, tag: str) -> None:
    """Kill the pool process every run; forgiven three stalls."""
    _kill_own_process(self, tag)


@app.task(bind=True, emq_max_stalled=None)
def poison_forever(self: Any, tag: str) -> None:
    """Kill the pool process every run; never dead-lettered."""
    _kill_own_process(self, tag)


@app.task(bind=True)
def poison_until_cured(self: Any, tag: str) -> str:
    """Kill the pool process every run until ``<prefix>cured:<tag>`` exists."""
    if not rec().exists(PREFIX + "cured:" + tag):
        _kill_own_process(self, tag)
    note_run(tag)
    return "cured"


@job_dead_lettered.connect
def _count_dead_letters(sender: Any, job: JobInfo, **kwargs: Any) -> None:
    rec().hincrby(PREFIX + "dead-signals", f"{job.task_name}:{job.task_id}:{job.reason}", 1)


# -- Pools: tasks that stop a worker's lease keeper, and where they ran ----------


def _hold_gil(seconds: float) -> None:
    """Block in a C call that keeps the GIL: no other thread of the process runs.

    ``ctypes.PyDLL`` calls do not release the GIL, so libc's ``usleep`` through it
    stands in for a long C extension call that never lets go of it.
    """
    import ctypes

    ctypes.PyDLL(None).usleep(int(seconds * 1_000_000))


def _block_hub(seconds: float) -> None:
    """Block the whole process in the unpatched ``time.sleep``: no greenlet runs.

    Under gevent or eventlet this is what a greenlet that never yields does (a
    blocking call their monkey-patching does not cover); elsewhere it is a sleep.
    """
    if "gevent" in sys.modules:
        from gevent import monkey

        monkey.get_original("time", "sleep")(seconds)
    elif "eventlet" in sys.modules:
        from eventlet import patcher

        patcher.original("time").sleep(seconds)
    else:
        time.sleep(seconds)


BLOCKERS = {"gil": _hold_gil, "hub": _block_hub, "sleep": time.sleep}


@app.task(bind=True)
def block_first_run(self: Any, seconds: float, tag: str, how: str) -> str:
    """Block for ``seconds`` (as ``BLOCKERS[how]`` does) on the first run only.

    Records each run's start (``started:<tag>``) and worker (``ran-on:<tag>``),
    and when the block ended (``unblocked:<tag>``).
    """
    n = note_run(tag)
    rec().rpush(PREFIX + "ran-on:" + tag, self.request.hostname)
    if n == 1:
        BLOCKERS[how](seconds)
        rec().rpush(PREFIX + "unblocked:" + tag, repr(time.time()))
    pipe = rec().pipeline()
    pipe.rpush(PREFIX + "done", tag)
    pipe.rpush(PREFIX + "done-on:" + tag, self.request.hostname)
    pipe.execute()
    return tag
