"""Flower on an emq:// app: nothing to configure beyond importing celery_emq."""

import os

from celery import Celery

import celery_emq  # noqa: F401  (also teaches Flower the emq:// scheme)

REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")

app = Celery("flowerex", broker=REDIS_URL.replace("redis://", "emq://", 1), backend=REDIS_URL)
app.conf.update(
    broker_transport_options={"global_keyprefix": "ex-flower:"},
    result_backend_transport_options={"global_keyprefix": "ex-flower:"},
    worker_send_task_events=True,
)


@app.task
def add(x: int, y: int) -> int:
    return x + y
