"""The benchmark's Celery app; the broker URL comes from ``BENCH_BROKER``."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_emq  # noqa: F401  (registers emq://)
from bench import roundtrips  # counts round trips when BENCH_ROUNDTRIPS_* is set

BROKER = os.environ.get("BENCH_BROKER", "emq://127.0.0.1:6379/12")
RECORD = os.environ.get("BENCH_RECORD", "redis://127.0.0.1:6379/12")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")

app = Celery("bench", broker=BROKER)
app.conf.update(
    broker_transport_options={"global_keyprefix": PREFIX},
    task_acks_late=os.environ.get("BENCH_ACKS_LATE", "0") == "1",
    worker_prefetch_multiplier=4,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)

# The drain timer's own writes are the benchmark's, not the transport's: never counted.
_r = roundtrips.uncounted(redis.Redis.from_url(RECORD))


@app.task
def tick() -> None:
    now = repr(time.time())
    pipe = _r.pipeline(transaction=False)
    pipe.setnx(PREFIX + "first", now)
    pipe.set(PREFIX + "last", now)
    pipe.incr(PREFIX + "count")
    pipe.execute()
