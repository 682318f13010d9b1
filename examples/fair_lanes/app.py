"""Fair lanes: a flood from one tenant does not starve another."""

import os
import time

import redis
from celery import Celery

import celery_emq  # noqa: F401

REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")

app = Celery("lanes", broker=REDIS_URL.replace("redis://", "emq://", 1))
app.conf.update(
    broker_transport_options={"global_keyprefix": "ex-lanes:"},
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
)
log = redis.Redis.from_url(REDIS_URL)


@app.task
def work(tenant: str, i: int) -> None:
    time.sleep(0.01)
    log.rpush("ex-lanes:order", f"{tenant}:{i}")


def submit(tenant: str, i: int) -> None:
    """Publish into the tenant's lane: the ``emq_group`` header names the group."""
    work.apply_async((tenant, i), headers={"emq_group": tenant})
