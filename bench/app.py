"""The benchmark's Celery app; the broker URL comes from ``BENCH_BROKER``.

Environment (set by the harness for each round):

- ``BENCH_BROKER``: the broker URL (``redis://`` or ``emq://``).
- ``BENCH_RECORD``: a plain Redis URL the tasks record what they saw into.
- ``BENCH_PREFIX``: the round's key prefix (kombu's ``global_keyprefix`` too).
- ``BENCH_BROKER_OPTIONS``: more broker transport options, a JSON object (e.g.
  ``{"master_name": "m"}`` for a Sentinel URL).
- ``BENCH_ACKS_LATE``: ``1`` for ``task_acks_late``.
- ``BENCH_PREFETCH``: the worker's prefetch multiplier (default 4).
- ``BENCH_ROUNDTRIPS_URL`` and ``BENCH_ROUNDTRIPS_KEY``: when both are set, this
  process counts its redis-py round trips into that key on that Redis
  (``bench/roundtrips.py``). The round-trip figure runs ``noop``, which records
  nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery, signals

import celery_emq  # noqa: F401  (registers emq://)
from bench import roundtrips  # counts round trips when BENCH_ROUNDTRIPS_* is set

BROKER = os.environ.get("BENCH_BROKER", "emq://127.0.0.1:6379/12")
RECORD = os.environ.get("BENCH_RECORD", "redis://127.0.0.1:6379/12")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")
RT_URL = os.environ.get("BENCH_ROUNDTRIPS_URL", "")
RT_KEY = os.environ.get("BENCH_ROUNDTRIPS_KEY", "")
if RT_URL and RT_KEY:
    from bench.roundtrips import install

    install(RT_URL, RT_KEY)

app = Celery("bench", broker=BROKER)
app.conf.update(
    broker_transport_options={
        **json.loads(os.environ.get("BENCH_BROKER_OPTIONS") or "{}"),
        "global_keyprefix": PREFIX,
    },
    task_acks_late=os.environ.get("BENCH_ACKS_LATE", "0") == "1",
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "4")),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)

# The drain timer's own writes are the benchmark's, not the transport's: never counted.
_r = roundtrips.uncounted(redis.Redis.from_url(RECORD))


@app.task
def tick() -> None:
    """Record the first and last run and count runs (one round trip of its own)."""
    now = repr(time.time())
    pipe = _r.pipeline(transaction=False)
    pipe.setnx(PREFIX + "first", now)
    pipe.set(PREFIX + "last", now)
    pipe.incr(PREFIX + "count")
    pipe.execute()


@app.task
def noop() -> None:
    """Do nothing: what a task costs the broker and nothing else."""


_drained = {"first": 0.0, "last": 0.0, "count": 0}
_drained_lock = threading.Lock()


@app.task
def drained() -> None:
    """A no-op that notes, in this process's memory only, when it ran (the drain rate).

    Each process writes its note when it exits (:func:`_report_drained`), so
    the timed drain makes no round trip of its own.
    """
    now = time.time()
    with _drained_lock:
        if not _drained["count"]:
            _drained["first"] = now
        _drained["last"] = now
        _drained["count"] += 1


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _report_drained(**kwargs: Any) -> None:
    # A prefork child leaves through worker_process_shutdown; the main process
    # (where the threads and solo pools run tasks) through worker_shutdown.
    with _drained_lock:
        if _drained["count"]:
            _r.rpush(PREFIX + "drained", json.dumps(_drained))
            _drained["count"] = 0


@app.task
def stamp(published_at: float) -> None:
    """Record how long after its publish this task started (seconds)."""
    _r.rpush(PREFIX + "latency", repr(time.time() - published_at))


@app.task
def nap(seconds: float) -> None:
    """Hold a pool slot (the held-task memory figure)."""
    time.sleep(seconds)
