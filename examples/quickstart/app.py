"""Quick start: a Celery app on the emq:// broker."""

import os

from celery import Celery

import celery_emq  # noqa: F401  (registers the emq:// and emqs:// URL schemes)

REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")

app = Celery(
    "quickstart",
    broker=REDIS_URL.replace("redis://", "emq://", 1),
    backend=REDIS_URL,
)
app.conf.update(
    broker_transport_options={
        "global_keyprefix": "ex-quickstart:",
        "lease_ms": 30_000,  # a worker renews this while it holds the task
        "max_stalled": 1,  # recover a stalled task once, dead-letter the second stall
    },
    result_backend_transport_options={"global_keyprefix": "ex-quickstart:"},
    task_acks_late=True,  # ack after the task ran: a crash mid-task is recovered
)


@app.task
def add(x: int, y: int) -> int:
    return x + y
