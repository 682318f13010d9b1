"""A stored message is decoded only in content types the reader accepts: pickle never by default."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Consumer, Exchange, Queue

from celery_emq import Morgue
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.jobs import describe

#: What unpickling a :class:`Tripwire` did (it must stay empty unless pickle is accepted).
UNPICKLED: list[str] = []

PICKLE = "application/x-python-serialize"


def tripwire(tag: str) -> str:
    """Called by unpickling a :class:`Tripwire`: the side effect a hostile payload has."""
    UNPICKLED.append(tag)
    return tag


class Tripwire:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (tripwire, ("unpickled",))

    def __repr__(self) -> str:
        return "Tripwire()"


@pytest.fixture(autouse=True)
def clean_tripwire() -> Iterator[None]:
    UNPICKLED.clear()
    yield
    UNPICKLED.clear()


def publish_pickled(app: Celery, store: JobStore) -> tuple[str, str, str]:
    """Publish a pickled Celery task; return its job id, its stored payload and its task id."""
    result = app.send_task("proj.tasks.evil", args=(Tripwire(),), serializer="pickle")
    [job_id] = [i.decode() for i in store.client.zrange(store.keys("celery").pending, 0, -1)]
    payload = store.job("celery", job_id)["payload"]
    assert UNPICKLED == []
    return job_id, payload, result.id


def test_describe_never_unpickles_by_default(app: Celery, store: JobStore) -> None:
    job_id, payload, task_id = publish_pickled(app, store)
    info = describe(payload, "celery", job_id)
    assert UNPICKLED == []
    assert info.decode_error is not None and "ContentDisallowed" in info.decode_error
    assert (info.task_name, info.task_id, info.args, info.kwargs) == (
        "proj.tasks.evil",
        task_id,
        None,
        None,
    )


def test_describe_unpickles_when_pickle_is_accepted(app: Celery, store: JobStore) -> None:
    job_id, payload, task_id = publish_pickled(app, store)
    info = describe(payload, "celery", job_id, accept=frozenset({"application/json", PICKLE}))
    assert UNPICKLED == ["unpickled"]
    assert info.decode_error is None
    assert (info.task_name, info.task_id, info.args, info.kwargs) == (
        "proj.tasks.evil",
        task_id,
        ("unpickled",),
        {},
    )


def test_the_morgue_never_unpickles_by_default(app: Celery, store: JobStore) -> None:
    job_id, _, task_id = publish_pickled(app, store)
    store.bury("celery", job_id, 0, "rejected", "", now_ms=1000)
    morgue = Morgue(store)
    [listed] = morgue.ls()
    shown = morgue.show(job_id)
    assert UNPICKLED == []
    assert shown is not None
    for job in (listed, shown):
        assert (job.id, job.task_name, job.task_id, job.args) == (
            job_id,
            "proj.tasks.evil",
            task_id,
            None,
        )
        assert job.decode_error is not None and "ContentDisallowed" in job.decode_error


def test_the_morgue_of_an_app_that_accepts_pickle_unpickles(app: Celery, store: JobStore) -> None:
    job_id, _, _ = publish_pickled(app, store)
    store.bury("celery", job_id, 0, "rejected", "", now_ms=1000)
    app.conf.accept_content = ["json", "pickle"]
    with Morgue.from_app(app) as morgue:
        job = morgue.show(job_id)
    assert job is not None
    assert UNPICKLED == ["unpickled"]
    assert (job.args, job.kwargs, job.decode_error) == (("unpickled",), {}, None)


def test_a_json_app_morgue_never_unpickles(app: Celery, store: JobStore) -> None:
    job_id, _, _ = publish_pickled(app, store)
    store.bury("celery", job_id, 0, "rejected", "", now_ms=1000)
    with Morgue.from_app(app) as morgue:
        [job] = morgue.ls()
    assert UNPICKLED == []
    assert job.decode_error is not None and "ContentDisallowed" in job.decode_error


def test_a_consumer_that_refuses_pickle_dead_letters_it_unread(
    app: Celery, store: JobStore, redis_url: str, prefix: str
) -> None:
    job_id, _, _ = publish_pickled(app, store)
    got: list[Any] = []
    with Connection(
        redis_url.replace("redis://", "emq://", 1), transport_options={"global_keyprefix": prefix}
    ) as conn:
        q = Queue("celery", Exchange("celery"), "celery")
        with Consumer(conn.channel(), [q], callbacks=[lambda b, m: got.append(b)], accept=["json"]):
            deadline = time.monotonic() + 3
            while not store.counts("celery")["dead"] and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    pass
    assert got == [] and UNPICKLED == []
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}
    row = store.job("celery", job_id)
    assert (row["state"], row["reason"]) == ("dead", "content_disallowed")
    assert "ContentDisallowed" in row["error"]
