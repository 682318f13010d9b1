"""End to end: tasks sent inside ``Producer.batch()`` each run once under a real worker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from kombu import Producer

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
