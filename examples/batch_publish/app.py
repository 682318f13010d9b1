"""Batch publishing: many tasks sent to Redis together (kombu 5.7's ``Producer.batch()``)."""

import os

import redis
from celery import Celery

import celery_emq  # noqa: F401

REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")

app = Celery("batch", broker=REDIS_URL.replace("redis://", "emq://", 1))
app.conf.update(
    broker_transport_options={"global_keyprefix": "ex-batch:"},
    task_ignore_result=True,
)
log = redis.Redis.from_url(REDIS_URL)


@app.task
def resize(image_id: int) -> None:
    log.hincrby("ex-batch:runs", str(image_id), 1)


def submit_all(image_ids: list[int]) -> None:
    """Send one task per image; Redis sees one round trip per 1,000 of them."""
    with app.producer_or_acquire() as producer:
        with producer.batch(max_size=1000):
            for image_id in image_ids:
                # Every option works as usual: countdown/eta, priority, emq_group, queue.
                resize.apply_async((image_id,), producer=producer)
    # The batch's last flush returned: every task is in its queue.
