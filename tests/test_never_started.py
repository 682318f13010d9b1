"""A job that lapses before its task ever starts: dead-lettered past ``max_lapsed``,
described from its headers alone (its body may kill whatever decodes it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.serialization import register, registry

from celery_emq import EmqOptions, Morgue, StalledJobError
from celery_emq.signals import job_dead_lettered, job_stalled
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.jobs import JobInfo, describe
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker import state as worker_state
from celery_emq.worker.follow_up import CeleryFollowUp
from tests.conftest import sweeps_ran_until

CONTENT_TYPE = "application/x-emq-tripwire"

#: How many times the tripwire serializer was asked to decode a body.
loads_calls: list[bytes] = []


def _tripwire_loads(body: Any) -> Any:
    loads_calls.append(body)
    raise RuntimeError("a body that would kill its decoder was decoded")


@pytest.fixture
def tripwire() -> Iterator[list[bytes]]:
    """A serializer whose ``loads`` records each call (the body stands for a fatal one)."""
    register("tripwire", json.dumps, _tripwire_loads, CONTENT_TYPE, "utf-8")
    loads_calls.clear()
    yield loads_calls
    registry.unregister("tripwire")


@pytest.fixture
def dead_letters() -> Iterator[list[JobInfo]]:
    got: list[JobInfo] = []
    stalls: list[JobInfo] = []

    def on_dead(sender: Any, job: JobInfo, **kw: Any) -> None:
        got.append(job)

    def on_stall(sender: Any, job: JobInfo, **kw: Any) -> None:
        stalls.append(job)

    job_dead_lettered.connect(on_dead)
    job_stalled.connect(on_stall)
    yield got
    job_dead_lettered.disconnect(on_dead)
    job_stalled.disconnect(on_stall)
    assert stalls == []  # a lapse before a start is never a stall


@pytest.mark.usefixtures("tripwire")
def test_the_describing_control_does_decode_an_accepted_body(app: Celery) -> None:
    """The tripwire works: a job that died otherwise has its accepted body decoded."""
    app.conf.accept_content = ["json", "tripwire"]
    body = json.dumps(
        {
            "headers": {"task": "t", "id": "i"},
            "content-type": CONTENT_TYPE,
            "properties": {},
            "body": "[[1], {}, {}]",
        }
    )
    info = describe(body, "celery", "j", reason="lease_expired", accept=frozenset({CONTENT_TYPE}))
    assert len(loads_calls) == 1
    assert info.decode_error == "DecodeError: a body that would kill its decoder was decoded"


def test_past_max_lapsed_a_job_is_dead_lettered_as_never_started_and_never_decoded(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    tripwire: list[bytes],
    dead_letters: list[JobInfo],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_state, "_nodename", None)
    app.conf.accept_content = ["json", "tripwire"]
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=1, max_lapsed=2), CeleryFollowUp(app))
    result = app.send_task("proj.doomed", args=("x" * 100,), serializer="tripwire")
    outcomes = []
    now = 1000
    for _ in range(3):
        [job] = store.claim("celery", "w1", now_ms=now)
        now += 5001
        sweeps_ran_until(store, "celery", now - 1)
        report = sweeper.sweep("celery", now_ms=now)
        outcomes.append((report.requeued, report.dead))
    assert outcomes == [([job.id], []), ([job.id], []), ([], [job.id])]

    [dead] = dead_letters
    assert (dead.task_name, dead.task_id, dead.args, dead.kwargs, dead.reason) == (
        "proj.doomed",
        result.id,
        None,
        None,
        "never_started",
    )
    body_bytes = len(
        json.dumps(
            [["x" * 100], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        )
    )
    assert dead.decode_error == (
        f"{CONTENT_TYPE}, {body_bytes} bytes, not decoded: the job never started, "
        "and decoding it may kill the process"
    )
    with pytest.raises(StalledJobError, match=r"before it started \(never_started\)"):
        result.get(timeout=5)

    morgue = Morgue(store, accept=frozenset({"application/json", CONTENT_TYPE}))
    [listed] = morgue.ls(reason="never_started")
    shown = morgue.show(result.id)
    assert shown is not None and shown == listed
    assert (listed.id, listed.task_name, listed.args, listed.reason, listed.last_error) == (
        job.id,
        "proj.doomed",
        None,
        "never_started",
        "never_started",
    )
    assert listed.decode_error == dead.decode_error
    assert listed.error == "never_started: lapsed 3 times before its task started, max_lapsed=2"
    assert tripwire == []
