"""End to end: tasks sent inside ``Producer.batch()`` each run once under a real worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import uuid4

import pytest
import redis
from kombu import Producer

from celery_emq.errors import NOT_STORED, STORED, UNKNOWN, BatchFlushError
from celery_emq.store.batch import Batch
from celery_emq.store.jobstore import JobStore

from .harness import Worker, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu before 5.7"),
]


def test_batched_tasks_each_run_once(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", 30000)
    n = 600
    empty = {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    with capp.producer_or_acquire() as producer:
        with producer.batch(max_size=250):
            for i in range(n):
                options: dict[str, Any] = {}
                if i % 5 == 1:
                    options["priority"] = 7
                elif i % 5 == 2:
                    options["headers"] = {"emq_group": f"tenant{i % 3}"}
                elif i % 5 == 3:
                    options["countdown"] = 2
                capp.send_task("tests.e2e.app.record", args=(i,), producer=producer, **options)
            # Flushed at 250 and 500: the last 100 wait for the end of the batch.
            assert store.counts("celery") == {
                "pending": 400,
                "active": 0,
                "delayed": 100,
                "dead": 0,
            }
    start_worker("-c", "2", "-P", "prefork")
    wait_for(lambda: client.hlen(prefix + "runs") == n, timeout=60, interval=0.3)
    counts = {int(k): int(v) for k, v in client.hgetall(prefix + "runs").items()}
    assert sorted(counts) == list(range(n))
    assert set(counts.values()) == {1}
    wait_for(lambda: store.counts("celery") == empty, 10)


def test_a_celery_caller_sends_again_what_a_failed_flush_names_and_each_task_runs_once(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = JobStore(client, prefix + "emq", 30000)
    n, size = 30, 10
    flushes: list[int] = []
    sent_through = Batch.execute

    def lose_the_second_reply(self: Batch, *args: Any, **kwargs: Any) -> None:
        sent_through(self, *args, **kwargs)
        flushes.append(1)
        if len(flushes) == 2:
            raise redis.ConnectionError("reply lost")

    monkeypatch.setattr(Batch, "execute", lose_the_second_reply)
    task_ids = [uuid4().hex for _ in range(n)]
    reached = 0
    with pytest.raises(BatchFlushError) as err, capp.producer_or_acquire() as producer:
        with producer.batch(max_size=size):
            for i, task_id in enumerate(task_ids):
                reached += 1
                capp.send_task(
                    "tests.e2e.app.record", args=(i,), task_id=task_id, producer=producer
                )
    failed = err.value
    # The second flush ran in Redis, but its reply was lost: its ten tasks
    # are named by their Celery task ids, of unknown outcome; the rest were not reached.
    assert reached == 2 * size
    assert failed.task_ids(UNKNOWN) == task_ids[size : 2 * size]
    assert failed.task_ids(STORED, NOT_STORED) == []
    assert store.counts("celery")["pending"] == 2 * size
    job_ids = {m.task_id: m.job_id for m in failed.messages}
    with capp.producer_or_acquire() as producer, producer.batch(max_size=size):
        for i, task_id in enumerate(task_ids[size:], start=size):
            options = {"emq_job_id": job_ids[task_id]} if task_id in job_ids else {}
            capp.send_task(
                "tests.e2e.app.record", args=(i,), task_id=task_id, producer=producer, **options
            )
    # Sent again with their job ids, the ten stored ones were not stored twice.
    assert store.counts("celery")["pending"] == n
    start_worker("-c", "2")
    wait_for(lambda: client.hlen(prefix + "runs") == n, timeout=60, interval=0.3)
    counts = {int(k): int(v) for k, v in client.hgetall(prefix + "runs").items()}
    assert sorted(counts) == list(range(n))
    assert set(counts.values()) == {1}
