"""Celery's own pytest fixtures (``celery_app``, ``celery_worker``) work in this project.

Installing the project's test extras must not swap Celery's in-process worker
fixture for another plugin's (pytest-celery's Docker worker registers a
``celery_worker`` of its own).
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def celery_config(redis_url: str, prefix: str) -> dict[str, Any]:
    return {
        "broker_url": redis_url.replace("redis://", "emq://", 1),
        "broker_transport_options": {"global_keyprefix": prefix, "lease_ms": 3000},
        "result_backend": redis_url,
        "result_backend_transport_options": {"global_keyprefix": prefix},
    }


@pytest.fixture
def celery_worker_pool() -> str:
    return "threads"


def test_classic_celery_worker_runs_a_task_on_emq(celery_app: Any, celery_worker: Any) -> None:
    from celery.contrib.testing.worker import TestWorkController

    assert isinstance(celery_worker, TestWorkController)

    @celery_app.task(name="fixtures.mul")
    def mul(x: int, y: int) -> int:
        return x * y

    celery_worker.reload()
    assert mul.delay(6, 7).get(timeout=10) == 42


def test_an_in_process_worker_leaves_no_node_behind(celery_app: Any, redis_url: str) -> None:
    # A dead-letter's failure event names the worker that swept it; a worker
    # that ran inside this process and stopped must not be named afterwards.
    from celery.contrib.testing.worker import start_worker

    from celery_emq.worker import state as worker_state

    with start_worker(celery_app, pool="threads", perform_ping_check=False) as w:
        assert worker_state.worker_nodename() == w.hostname
    assert worker_state.worker_nodename() is None
