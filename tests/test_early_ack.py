"""A succeeded acks_late task is acked by its own process once its result is stored."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_postrun, task_prerun, task_success

from celery_emq.store.jobstore import JobStore
from celery_emq.transport.lease import keeper
from celery_emq.transport.settle import batcher
from celery_emq.worker import starts
from tests.conftest import started_mark


@pytest.fixture
def held(store: JobStore) -> Iterator[tuple[Any, str]]:
    """A task whose request names a claim this process holds, as under a solo worker."""
    starts.install()
    app = Celery("early", set_as_current=False)

    @app.task(acks_late=True)
    def job() -> None: ...

    store.enqueue("q", "a", b"{}")
    [claim] = store.claim("q", "w")
    [tag] = keeper().hold(store, "q", [(claim.id, claim.token)], 10_000)
    job.push_request(properties={"delivery_tag": f"a#{claim.token}"})
    yield job, tag
    job.pop_request()
    keeper().forget(tag)


def test_task_success_acks_the_claim(held: tuple[Any, str], store: JobStore) -> None:
    job, tag = held
    task_success.send(sender=job, result=None)
    assert store.job("q", "a") == {}
    assert store.metrics("q")["completed"] == 1
    assert keeper().get(tag) is None


def test_postrun_alone_does_not_ack(held: tuple[Any, str], store: JobStore) -> None:
    # Celery sends task_postrun with state SUCCESS even when storing the result
    # failed afterwards; only task_success says the result is stored.
    job, tag = held
    task_postrun.send(sender=job, task_id="t", task=job, state="SUCCESS", retval=None)
    assert store.job("q", "a")["state"] == "active"
    assert keeper().get(tag) is not None


def test_in_a_ready_worker_the_ack_goes_with_the_next_start(
    held: tuple[Any, str], store: JobStore
) -> None:
    # Deferred for company, the ack of a finished task must still reach Redis
    # before the next task's body runs: that task may kill the process.
    job, tag = held
    b = batcher()
    saved = (b.delay_ms, b.deferring)
    b.delay_ms, b.deferring = 60_000, True
    store.enqueue("q", "next", b"{}")
    [nxt] = store.claim("q", "w")
    [next_tag] = keeper().hold(store, "q", [(nxt.id, nxt.token)], 10_000)
    try:
        task_success.send(sender=job, result=None)
        assert keeper().get(tag) is None
        assert store.job("q", "a")["state"] == "active"  # queued, not sent
        job.push_request(properties={"delivery_tag": f"next#{nxt.token}"})
        try:
            task_prerun.send(sender=job, task_id="t2", task=job)
        finally:
            job.pop_request()
        assert store.job("q", "a") == {}
        assert store.job("q", "next")["started"] == started_mark(nxt.token)
        assert b.queued() == 0
    finally:
        b.flush()
        b.delay_ms, b.deferring = saved
        keeper().forget(next_tag)
