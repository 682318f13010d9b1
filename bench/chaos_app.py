"""The Celery app the chaos run's workers load, configured by ``CHAOS_*`` variables.

``CHAOS_BROKER`` (an ``emq://`` URL), ``CHAOS_LEDGER`` (a file path),
``CHAOS_LEASE_MS``, ``CHAOS_SWEEP_S`` and ``CHAOS_MAX_STALLED`` (a number, or
``none``: never dead-letter).

Each run of :func:`work` appends one JSON line to the ledger when it starts
(``S``: task id, run id, time, pid, worker, job id, claim token, stall count)
and one when its body finishes (``E``). A line is one ``write`` on an
``O_APPEND`` descriptor, so lines from prefork children and threads never
interleave, and a run killed mid-task leaves a whole ``S`` line and no ``E``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any

from celery import Celery

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.worker.state import request_claim

TASK_NAME = "chaos.work"


def make_conf(
    broker_url: str, lease_ms: int, sweep_interval_s: float, max_stalled: int | None
) -> dict[str, Any]:
    """Return the Celery settings shared by the workers and the publisher."""
    return {
        "broker_url": broker_url,
        "broker_transport_options": {
            "lease_ms": lease_ms,
            "sweep_interval_s": sweep_interval_s,
            "max_stalled": max_stalled,
        },
        "broker_connection_retry_on_startup": True,
        "task_acks_late": True,
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 4,
        "worker_hijack_root_logger": False,
    }


def parse_max_stalled(value: str) -> int | None:
    return None if value.lower() == "none" else int(value)


LEDGER = os.environ.get("CHAOS_LEDGER", "")

app = Celery("chaos")
app.conf.update(
    make_conf(
        os.environ.get("CHAOS_BROKER", "emq://127.0.0.1:6379/0"),
        int(os.environ.get("CHAOS_LEASE_MS", "3000")),
        float(os.environ.get("CHAOS_SWEEP_S", "0.5")),
        parse_max_stalled(os.environ.get("CHAOS_MAX_STALLED", "none")),
    )
)

_fd: tuple[int, int] | None = None
_fd_lock = threading.Lock()


def _write(record: dict[str, Any]) -> None:
    """Append one ledger line (one ``write``); the descriptor is reopened after a fork."""
    global _fd
    with _fd_lock:
        if _fd is None or _fd[0] != os.getpid():
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            _fd = (os.getpid(), os.open(LEDGER, flags, 0o644))
        fd = _fd[1]
    os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


@app.task(bind=True, name=TASK_NAME)
def work(self: Any, seconds: float) -> None:
    """Sleep ``seconds``, writing the run's start and end to the ledger."""
    run = uuid.uuid4().hex[:16]
    job, token = request_claim(self.request) or (None, None)
    _write(
        {
            "e": "S",
            "task": self.request.id,
            "run": run,
            "t": time.time(),
            "pid": os.getpid(),
            "worker": self.request.hostname,
            "job": job,
            # The claim's delivery count orders the claims of one job.
            "token": int(token.split(".")[0]) if token else None,
            "stalled": getattr(self.request, "emq_stalled", 0) or 0,
        }
    )
    time.sleep(seconds)
    _write({"e": "E", "task": self.request.id, "run": run, "t": time.time()})
