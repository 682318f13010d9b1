"""Where a task's start is recorded."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_prerun

from celery_emq import worker_state
from celery_emq.lease import keeper
from celery_emq.settle import SettleBatcher, batcher
from celery_emq.store import JobStore


@pytest.fixture
def worker_batcher() -> Iterator[SettleBatcher]:
    """The process-wide batcher, deferring as in a ready worker; restored afterwards."""
    b = batcher()
    b.flush()
    saved = (b.delay_ms, b.deferring)
    b.delay_ms, b.deferring = 60_000, True
    yield b
    b.flush()
    b.delay_ms, b.deferring = saved


@pytest.fixture
def claimed(store: JobStore) -> Iterator[tuple[str, int]]:
    """One job claimed and held by this process's keeper: (tag, token)."""
    store.enqueue("q", "a", b"{}")
    [claim] = store.claim("q", "w")
    [tag] = keeper().hold(store, "q", [(claim.id, claim.deliveries)], 10_000)
    yield tag, claim.deliveries
    keeper().forget(tag)
    with worker_state._submitted_lock:
        worker_state._submitted.pop(tag, None)


def accepted(tag: str) -> Any:
    """Just what the accept probe reads of a Celery request."""
    return SimpleNamespace(message=SimpleNamespace(delivery_tag=tag))


def test_a_job_a_prefork_child_accepted_is_recorded_started_by_the_worker(
    worker_batcher: SettleBatcher, claimed: tuple[str, int], store: JobStore
) -> None:
    tag, token = claimed
    with worker_state._submitted_lock:
        worker_state._submitted[tag] = object()  # the prefork pool's job for it
    worker_state._note_accepted(accepted(tag))
    # Queued with the worker's acks, not a round trip of its own.
    assert worker_batcher.queued() == 1
    assert "started" not in store.job("q", "a")
    worker_batcher.flush()
    assert store.job("q", "a")["started"] == str(token)


def test_a_job_of_another_pool_records_its_own_start(
    worker_batcher: SettleBatcher, claimed: tuple[str, int], store: JobStore
) -> None:
    tag, _ = claimed
    with worker_state._submitted_lock:
        worker_state._submitted[tag] = None  # solo, threads, gevent, eventlet
    worker_state._note_accepted(accepted(tag))
    assert worker_batcher.queued() == 0


def test_a_prefork_child_sends_nothing_when_its_task_starts(
    worker_batcher: SettleBatcher, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child's keeper holds no claim (its worker does): it leaves the record
    # to the worker, and makes no round trip before the task's body.
    worker_state._install_start_recorder()
    store.enqueue("q", "a", b"{}")
    [claim] = store.claim("q", "w")
    app = Celery("child", set_as_current=False)

    @app.task
    def job() -> None: ...

    sent: list[Any] = []
    monkeypatch.setattr(SettleBatcher, "flush", lambda self, start=None: sent.append(start))
    job.push_request(emq_claim=["q", "a", claim.deliveries])
    try:
        task_prerun.send(sender=job, task_id="t", task=job)
    finally:
        job.pop_request()
    assert sent == []
    assert "started" not in store.job("q", "a")
