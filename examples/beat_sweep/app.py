"""A beat-scheduled sweep: ``celery_emq.sweep`` every few seconds.

Every worker already sweeps the queues it consumes; a beat entry adds a sweep
that runs even when the only workers left consume other queues.
"""

import os

from celery import Celery

import celery_emq

REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")

app = Celery("beat_sweep", broker=REDIS_URL.replace("redis://", "emq://", 1), backend=REDIS_URL)
app.conf.update(
    broker_transport_options={
        "global_keyprefix": "ex-beat:",
        "lease_ms": 5_000,
        # Only so this example shows beat at work: the worker's own timer waits an hour.
        "sweep_interval_s": float(os.environ.get("EX_WORKER_SWEEP_S", "5")),
    },
    result_backend_transport_options={"global_keyprefix": "ex-beat:"},
    task_acks_late=True,
)

# One line: a beat entry for celery_emq.sweep (expiring, so missed runs don't pile up).
celery_emq.schedule_sweep(app, every_s=2)


@app.task
def add(x: int, y: int) -> int:
    return x + y
