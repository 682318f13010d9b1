"""What a consumer asks of its host as it receives a job: the task's own budget, a revoke."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery._state import get_current_app
from kombu import Exchange, Producer, Queue

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import UNSET
from celery_emq.transport import process
from celery_emq.transport.lease import parse_tag
from celery_emq.transport.process import NoHost
from celery_emq.worker.state import CeleryHost
from tests.transport.conftest import ConnFactory


class Knowing(NoHost):
    """A host that knows one task's budget and notes each revoke it is told of."""

    def __init__(self, budgets: dict[str, object]) -> None:
        self.budgets = budgets
        self.revokes: list[str] = []

    def task_budget(self, task_name: str) -> object:
        return self.budgets.get(task_name, UNSET)

    def revoked(self, task_id: str) -> None:
        self.revokes.append(task_id)


@pytest.fixture
def knowing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Knowing]:
    host = Knowing({"proj.three": 3, "proj.never": None, "proj.bad": "lots"})
    monkeypatch.setattr(process, "_host", host)
    yield host


def publish_task(connect: ConnFactory, name: str, task_id: str, **headers: Any) -> None:
    q = Queue("q", Exchange("q", "direct"), routing_key="q")
    with connect() as conn:
        Producer(conn.channel()).publish(
            [[], {}, {}],
            exchange=q.exchange,
            routing_key="q",
            declare=[q],
            headers={"task": name, "id": task_id, **headers},
        )


def receive(connect: ConnFactory, store: JobStore) -> tuple[Any, dict[str, str]]:
    """Receive the one job of ``q``; return the message and its job's row as it was handed on."""
    with connect() as conn:
        message = conn.channel().basic_get("q")
        assert message is not None
        claim = parse_tag(message.delivery_tag)
        assert claim is not None
        row = store.job("q", claim[0])
        message.ack()
        return message, row


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", lease_ms=30_000)


@pytest.mark.parametrize(
    ("task", "written"), [("proj.three", "3"), ("proj.never", "-1"), ("proj.bad", None)]
)
def test_a_tasks_own_budget_is_asked_of_the_host_and_written_on_its_job(
    connect: ConnFactory,
    store: JobStore,
    knowing: Knowing,
    monkeypatch: pytest.MonkeyPatch,
    task: str,
    written: str | None,
) -> None:
    publish_task(connect, task, "t1")
    _, row = receive(connect, store)
    assert row.get("max_stalled") == written


def test_a_plain_consumer_writes_no_task_budget(
    connect: ConnFactory, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "_host", NoHost())
    publish_task(connect, "proj.three", "t1")
    _, row = receive(connect, store)
    assert "max_stalled" not in row


def test_a_job_revoked_while_delayed_is_told_to_the_host(
    connect: ConnFactory, store: JobStore, knowing: Knowing
) -> None:
    eta = (datetime.now(timezone.utc) + timedelta(minutes=5)).isoformat()
    publish_task(connect, "proj.three", "doomed", eta=eta)
    assert store.counts("q")["delayed"] == 1
    assert store.promote_tasks("q", ["doomed"]) == 1
    message, _ = receive(connect, store)
    assert message.headers["id"] == "doomed"
    assert knowing.revokes == ["doomed"]


def test_celerys_host_reads_the_current_apps_task_and_celerys_revokes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = Celery("budgets", set_as_current=False)

    @app.task(name="proj.three", emq_max_stalled=3)
    def three() -> None: ...

    @app.task(name="proj.plain")
    def plain() -> None: ...

    host = CeleryHost()
    previous = get_current_app()
    app.set_current()
    try:
        assert host.task_budget("proj.three") == 3
        assert host.task_budget("proj.plain") is UNSET
        assert host.task_budget("proj.unknown") is UNSET
    finally:
        previous.set_current()
    revoked: set[str] = set()
    monkeypatch.setitem(sys.modules, "celery.worker.state", SimpleNamespace(revoked=revoked))
    host.revoked("t9")
    assert revoked == {"t9"}


class Deleting(Knowing):
    """A host whose answer comes after the job's row is gone (purged, trimmed, expired)."""

    def __init__(self, client: redis.Redis, row: str) -> None:
        super().__init__({"proj.three": 3})
        self.client, self.row = client, row

    def task_budget(self, task_name: str) -> object:
        self.client.delete(self.row)
        return super().task_budget(task_name)


def test_a_task_budget_never_recreates_a_row_deleted_before_it_is_written(
    connect: ConnFactory, store: JobStore, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_task(connect, "proj.three", "t1")
    [job_id] = [raw.decode() for raw in client.zrange(store.keys("q").pending, 0, -1)]
    row = store.keys("q").job(job_id)
    monkeypatch.setattr(process, "_host", Deleting(client, row))
    with connect() as conn:
        conn.channel().basic_get("q")
    # A plain HSET would leave a row of one field and no TTL, for ever.
    assert client.exists(row) == 0
