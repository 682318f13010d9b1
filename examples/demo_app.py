"""The demo's Celery app: the broker is ``emq://`` on ``$EMQ_DEMO_REDIS_URL``."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import redis
from celery import Celery

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.signals import job_dead_lettered
from celery_emq.transport.jobs import JobInfo

REDIS_URL = os.environ.get("EMQ_DEMO_REDIS_URL", "redis://127.0.0.1:6379/13")
PREFIX = os.environ.get("EMQ_DEMO_PREFIX", "demo:")
LEASE_MS = int(os.environ.get("EMQ_DEMO_LEASE_MS", "3000"))

app = Celery("demo")
app.conf.update(
    broker_url=REDIS_URL.replace("redis://", "emq://", 1),
    result_backend=REDIS_URL,
    broker_transport_options={
        "global_keyprefix": PREFIX,
        "lease_ms": LEASE_MS,
        "sweep_interval_s": 1.0,
        "max_stalled": 1,
    },
    result_backend_transport_options={"global_keyprefix": PREFIX},
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_r = redis.Redis.from_url(REDIS_URL)


def note(tag: str, hostname: str | None) -> None:
    """Record one run of ``tag`` and where it ran."""
    _r.rpush(f"{PREFIX}runs:{tag}", f"{time.time()} {hostname}")


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task(bind=True)
def slow(self: Any, seconds: float, tag: str) -> float:
    """Sleep, counting its runs and where they happen."""
    note(tag, self.request.hostname)
    time.sleep(seconds)
    return seconds


@app.task(bind=True)
def crash(self: Any, tag: str) -> str:
    """Kill the pool process running it, unless ``<prefix>cured:<tag>`` exists."""
    note(tag, self.request.hostname)
    if not _r.exists(f"{PREFIX}cured:{tag}"):
        os.kill(os.getpid(), signal.SIGKILL)
    return "cured"


@job_dead_lettered.connect
def alert(sender: Any, job: JobInfo, **kwargs: Any) -> None:
    """The failure handler: a log line and an entry in an alert list."""
    text = f"{job.task_name}[{job.task_id}] dead after {job.stalled} stalls ({job.reason})"
    logging.getLogger("alerts").error(text)
    _r.rpush(f"{PREFIX}alerts", text)
