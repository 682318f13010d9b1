"""A task that kills its process, tested on a prefork worker (no Docker)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_emq import StalledJobError

from . import tasks


@pytest.fixture
def emq_worker_parameters() -> dict[str, Any]:
    """A prefork pool: the task dies in a child process, and pytest lives on."""
    return {"pool": "prefork", "concurrency": 1, "shutdown_timeout": 15.0}


def test_a_task_that_kills_its_process_is_dead_lettered(emq_worker: Any, emq: Any) -> None:
    result = tasks.crash.delay()
    with pytest.raises(StalledJobError):
        result.get(timeout=30)  # the worker saw its child die: a stall, and no budget left

    [dead] = emq.dead(task_id=result.id)
    assert (dead.task_name, dead.reason, dead.stalled) == ("shop.crash", "worker_lost", 1)
