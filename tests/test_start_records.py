"""Where a task's start is recorded, and how a busy worker tops up its prefetch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_prerun

from celery_emq.store.jobstore import JobStore
from celery_emq.transport.lease import keeper
from celery_emq.transport.qos import refill_at
from celery_emq.transport.settle import SettleBatcher, batcher
from celery_emq.worker import marks, starts
from celery_emq.worker import pool as worker_pool
from tests.conftest import started_mark


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
    [tag] = keeper().hold(store, "q", [(claim.id, claim.token)], 10_000)
    yield tag, claim.token
    keeper().forget(tag)
    marks.settled(tag)


def accepted(tag: str) -> Any:
    """Just what the accept probe reads of a Celery request."""
    return SimpleNamespace(message=SimpleNamespace(delivery_tag=tag))


def test_a_job_a_prefork_child_accepted_is_recorded_started_by_the_worker(
    worker_batcher: SettleBatcher, claimed: tuple[str, int], store: JobStore
) -> None:
    tag, token = claimed
    marks.submit(tag, object())  # the prefork pool's job for it
    starts.note_accepted(accepted(tag))
    # Queued with the worker's acks, not a round trip of its own.
    assert worker_batcher.queued() == 1
    assert "started" not in store.job("q", "a")
    worker_batcher.flush()
    assert store.job("q", "a")["started"] == started_mark(token)


def test_a_job_of_another_pool_records_its_own_start(
    worker_batcher: SettleBatcher, claimed: tuple[str, int], store: JobStore
) -> None:
    tag, _ = claimed
    marks.submit(tag)  # solo, threads, gevent, eventlet
    starts.note_accepted(accepted(tag))
    assert worker_batcher.queued() == 0


def test_a_prefork_child_sends_nothing_when_its_task_starts(
    worker_batcher: SettleBatcher, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child's keeper holds no claim (its worker does): it leaves the record
    # to the worker, and makes no round trip before the task's body.
    starts.install()
    store.enqueue("q", "a", b"{}")
    [claim] = store.claim("q", "w")
    app = Celery("child", set_as_current=False)

    @app.task
    def job() -> None: ...

    sent: list[Any] = []
    monkeypatch.setattr(SettleBatcher, "start_now", lambda self, claim: sent.append(claim))
    monkeypatch.setattr(SettleBatcher, "flush", lambda self: sent.append(None))
    job.push_request(properties={"delivery_tag": f"a#{claim.token}"})
    try:
        task_prerun.send(sender=job, task_id="t", task=job)
    finally:
        job.pop_request()
    assert sent == []
    assert "started" not in store.job("q", "a")


def test_a_busy_worker_claims_again_once_half_its_prefetch_is_free() -> None:
    assert [refill_at(n) for n in (1, 2, 3, 8, 9)] == [1, 1, 1, 4, 4]


@pytest.fixture
def ready_pool(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ready worker's prefork pool of two; Celery's reserved requests under the test's control."""
    from celery.concurrency.prefork import TaskPool

    pool = TaskPool.__new__(TaskPool)
    pool.limit = 2
    monkeypatch.setattr(worker_pool, "_pool", pool)
    state = SimpleNamespace(reserved_requests=set())
    monkeypatch.setitem(sys.modules, "celery.worker.state", state)
    return state


def qos_holding(n: int, prefetch: int = 8) -> Any:
    from celery_emq.transport.qos import QoS

    qos = QoS.__new__(QoS)
    qos.prefetch_count = prefetch
    qos._delivered = {str(i): None for i in range(n)}
    qos._dirty = set()
    return qos


def test_can_consume_waits_for_half_the_prefetch_while_the_pool_is_busy(ready_pool: Any) -> None:
    ready_pool.reserved_requests = {f"r{i}" for i in range(5)}
    assert not qos_holding(5).can_consume()
    assert qos_holding(4).can_consume()
    assert not qos_holding(8).can_consume()


def test_can_consume_claims_at_once_when_a_pool_process_may_idle(ready_pool: Any) -> None:
    # Seven held, but only two runnable (the rest wait for their ETA): the
    # pool of two could idle, so a free slot is filled at once.
    ready_pool.reserved_requests = {"r0", "r1"}
    assert qos_holding(7).can_consume()
    assert not qos_holding(8).can_consume()


def test_without_a_ready_worker_a_free_slot_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_pool, "_pool", None)
    assert qos_holding(7).can_consume()
    assert qos_holding(0, prefetch=0).can_consume()


def test_a_threads_worker_claims_whenever_a_slot_is_free(
    ready_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A finished task does not wake the event loop of a threads worker: a claim
    # put off could wait for the loop's next turn (up to a second).
    from celery.concurrency.thread import TaskPool

    pool = TaskPool.__new__(TaskPool)
    pool.limit = 2
    monkeypatch.setattr(worker_pool, "_pool", pool)
    ready_pool.reserved_requests = {f"r{i}" for i in range(7)}
    assert qos_holding(7).can_consume()
