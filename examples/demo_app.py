"""The demo's Celery app: the broker is ``emq://`` on ``$EMQ_DEMO_REDIS_URL``."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_emq  # noqa: F401  (registers emq://)

REDIS_URL = os.environ.get("EMQ_DEMO_REDIS_URL", "redis://127.0.0.1:6379/13")
PREFIX = os.environ.get("EMQ_DEMO_PREFIX", "demo:")
LEASE_MS = int(os.environ.get("EMQ_DEMO_LEASE_MS", "3000"))

app = Celery("demo")
app.conf.update(
    broker_url=REDIS_URL.replace("redis://", "emq://", 1),
    result_backend=REDIS_URL,
    broker_transport_options={"global_keyprefix": PREFIX, "lease_ms": LEASE_MS},
    result_backend_transport_options={"global_keyprefix": PREFIX},
    task_acks_late=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_r = redis.Redis.from_url(REDIS_URL)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def slow(seconds: float) -> float:
    """Sleep well past the lease, counting its runs."""
    _r.hincrby(PREFIX + "runs", "slow", 1)
    time.sleep(seconds)
    return seconds
