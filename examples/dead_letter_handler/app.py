"""A dead-letter handler that forwards to a log and an alert sink."""

import logging
import os
import signal
from typing import Any

import redis
from celery import Celery

import celery_emq  # noqa: F401
from celery_emq.signals import job_dead_lettered
from celery_emq.transport.jobs import JobInfo

REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")

app = Celery("dlh", broker=REDIS_URL.replace("redis://", "emq://", 1), backend=REDIS_URL)
app.conf.update(
    broker_transport_options={"global_keyprefix": "ex-dlh:", "max_stalled": 1},
    result_backend_transport_options={"global_keyprefix": "ex-dlh:"},
    task_acks_late=True,
)

alerts = logging.getLogger("alerts")
sink = redis.Redis.from_url(REDIS_URL)


@job_dead_lettered.connect
def forward(sender: Any, job: JobInfo, **kwargs: Any) -> None:
    """Called once per dead-lettered job, in the process that ran the sweep."""
    message = (
        f"{job.task_name}[{job.task_id}] dead-lettered from {job.queue} after "
        f"{job.stalled} stalls ({job.reason}); args={job.args!r}"
    )
    alerts.error(message)
    sink.rpush("ex-dlh:alerts", message)  # stand-in for a pager, a chat hook, ...


@app.task
def crash(n: int) -> None:
    """A poison task: kills the pool process running it, every time."""
    os.kill(os.getpid(), signal.SIGKILL)
