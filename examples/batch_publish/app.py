"""Batch publishing: many tasks sent to Redis together (kombu 5.7's ``Producer.batch()``)."""

import os

import redis
from celery import Celery
from celery.utils import uuid

import celery_emq
from celery_emq.errors import STORED

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


def submit_all(image_ids: list[int], attempts: int = 3) -> None:
    """Send one task per image; Redis sees one round trip per 1,000 of them.

    A flush that fails raises ``celery_emq.BatchFlushError`` (kombu's
    ``BatchPublishError``), naming each task by its id with what became of it.
    The tasks not known to be stored are sent again with their task id and job
    id (``emq_job_id``): one that was stored after all is not stored twice.
    """
    # (task id, image id, job id): the job id once a failed flush named it.
    todo: list[tuple[str, int, str | None]] = [(uuid(), i, None) for i in image_ids]
    for _ in range(attempts):
        reached = 0
        try:
            with app.producer_or_acquire() as producer:
                with producer.batch(max_size=1000):
                    for task_id, image_id, job_id in todo:
                        reached += 1
                        # Every option works as usual: countdown/eta, priority, emq_group, queue.
                        options = {"emq_job_id": job_id} if job_id else {}
                        resize.apply_async(
                            (image_id,), task_id=task_id, producer=producer, **options
                        )
            # The batch's last flush returned: every task is in its queue.
            return
        except celery_emq.BatchFlushError as exc:
            again = {m.task_id: m.job_id for m in exc.messages if m.outcome != STORED}
            # Those the error names as not stored or unknown, then those not reached.
            todo = [(t, i, again[t]) for t, i, _ in todo[:reached] if t in again] + todo[reached:]
    raise RuntimeError(f"{len(todo)} task(s) still not sent after {attempts} attempts")
