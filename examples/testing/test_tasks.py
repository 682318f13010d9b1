"""Testing tasks on emq:// with celery_emq's pytest fixtures (no Docker)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from . import tasks


@pytest.fixture
def released() -> Iterator[None]:
    """Let a stuck ``poison`` task return once the test is done with it."""
    tasks.released.clear()
    yield
    tasks.released.set()


def test_a_task_runs(emq_worker: Any) -> None:
    assert tasks.add.delay(2, 3).get(timeout=10) == 5


def test_a_shared_task_publishes_through_the_test_app(emq_app: Any) -> None:
    # A shared_task follows the current app: emq_app, on the test's Redis and prefix.
    # A task defined with @proj.task would publish through proj's own broker instead.
    assert tasks.add.app is emq_app


def test_a_poison_task_is_dead_lettered(emq_worker: Any, emq: Any, released: None) -> None:
    result = tasks.poison.delay()
    emq.wait_started(result.id)  # a worker holds it and its task runs

    emq.lapse(result.id)  # as if that worker had died: its lease lapses
    emq.sweep()  # (the worker's own sweep may be first: the outcome is the same)

    [dead] = emq.dead(task_id=result.id)
    assert (dead.task_name, dead.reason, dead.stalled) == ("shop.poison", "lease_expired", 1)
    assert result.state == "FAILURE"  # the caller hears of it, too
