"""Who hears of a sweep: the follow-up a Sweeper is given, or the one registered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any

import pytest
import redis
from celery import Celery

from celery_emq import EmqOptions, StalledJobError
from celery_emq.ops.tasks import SWEEP_TASK
from celery_emq.signals import job_dead_lettered, job_recovered, job_stalled
from celery_emq.store.jobstore import JobStore
from celery_emq.store.scripts import Outcome
from celery_emq.transport import follow_up as follow_ups
from celery_emq.transport.follow_up import LogOnly
from celery_emq.transport.jobs import DEFAULT_ACCEPT, JobInfo
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker.follow_up import CeleryFollowUp
from tests.conftest import sweeps_ran_until


@pytest.fixture
def signalled() -> Iterator[list[str]]:
    got: list[str] = []

    def noting(name: str) -> Callable[..., None]:
        def handler(sender: Any, job: JobInfo, **kw: Any) -> None:
            got.append(f"{name} {job.id}")

        return handler

    handlers = {
        job_stalled: noting("stalled"),
        job_recovered: noting("recovered"),
        job_dead_lettered: noting("dead"),
    }
    for signal, handler in handlers.items():
        signal.connect(handler, weak=False)
    yield got
    for signal, handler in handlers.items():
        signal.disconnect(handler)


@pytest.fixture
def events(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """The events the app sends: (the node sending, the type, the task id)."""
    sent: list[tuple[str, str, Any]] = []

    class Dispatcher:
        def __init__(self, hostname: str) -> None:
            self.hostname = hostname

        def __enter__(self) -> Dispatcher:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def send(self, kind: str, **fields: Any) -> None:
            sent.append((self.hostname, kind, fields.get("uuid")))

    monkeypatch.setattr(
        type(app.events), "default_dispatcher", lambda _e, hostname, **kw: Dispatcher(hostname)
    )
    return sent


def lapse(app: Celery, store: JobStore, now_ms: int) -> tuple[Any, str]:
    """Publish a task, claim it at ``now_ms`` and start it: its lease lapses later."""
    result = app.send_task("proj.tasks.poison", args=(1,))
    [job] = store.claim("celery", "w1", now_ms=now_ms)
    assert store.start("celery", job.id, job.token) is Outcome.OK
    return result, job.id


class Recording:
    """A follow-up that notes every call it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def accept(self) -> frozenset[str]:
        return DEFAULT_ACCEPT

    def succeeded(self, info: JobInfo, since_ms: int | None) -> bool:
        self.calls.append(f"succeeded {info.id}")
        return False

    def stalled(self, info: JobInfo) -> None:
        self.calls.append(f"stalled {info.id}")

    def recovered(self, info: JobInfo) -> None:
        self.calls.append(f"recovered {info.id}")

    def dead_lettered(self, info: JobInfo) -> None:
        self.calls.append(f"dead {info.id}")

    def failed(self, info: JobInfo, last_holder: Callable[[], str | None]) -> None:
        self.calls.append(f"failed {info.id} from {last_holder()}")


class Raising(Recording):
    """A follow-up every method of which raises, after noting the call."""

    def __getattribute__(self, name: str) -> Any:
        method = super().__getattribute__(name)
        if name in ("calls", "accept") or not callable(method):
            return method

        @wraps(method)
        def raising(*args: Any) -> Any:
            method(*args)
            raise RuntimeError(f"{name} bug")

        return raising


def test_importing_the_package_registers_celerys_follow_up() -> None:
    registered = follow_ups.follow_up()
    assert isinstance(registered, CeleryFollowUp)
    assert registered.node is None  # the current app, this process's worker


def test_a_sweeper_given_no_follow_up_uses_the_registered_one(
    client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = Recording()
    monkeypatch.setattr(follow_ups, "_follow_up", recording)
    store = JobStore(client, prefix + "emq", 5000)
    assert Sweeper(store, EmqOptions()).follow_up is recording


def test_the_sweep_hands_each_job_to_its_follow_up_in_order(
    app: Celery, client: redis.Redis, prefix: str, signalled: list[str]
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    recording = Recording()
    sweeper = Sweeper(store, EmqOptions(max_stalled=1), recording)
    _, job_id = lapse(app, store, 1000)
    assert sweeper.sweep("celery", now_ms=7000).recovered == [job_id]
    [job] = store.claim("celery", "w2@host:1:x", now_ms=8000)
    assert store.start("celery", job.id, job.token) is Outcome.OK
    sweeps_ran_until(store, "celery", 13_999)
    assert sweeper.sweep("celery", now_ms=14_000).dead == [job_id]
    assert recording.calls == [
        f"stalled {job_id}",
        f"recovered {job_id}",
        f"succeeded {job_id}",
        f"stalled {job_id}",
        f"dead {job_id}",
        f"failed {job_id} from w2@host",
    ]
    assert signalled == []  # only the follow-up given hears of it


def test_without_celerys_follow_up_a_sweep_only_logs(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    signalled: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    result, job_id = lapse(app, store, 1000)
    report = Sweeper(store, EmqOptions(max_stalled=0), LogOnly()).sweep("celery", now_ms=7000)
    assert report.dead == [job_id]
    assert signalled == []
    assert result.state == "PENDING"  # no result stored
    assert "dead-lettered from celery after 1 stalls" in caplog.text


def test_a_failing_follow_up_never_breaks_the_sweep(
    app: Celery, client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    raising = Raising()
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), raising)
    _, a = lapse(app, store, 1000)
    _, b = lapse(app, store, 1000)
    report = sweeper.sweep("celery", now_ms=7000)
    assert sorted(report.dead) == sorted([a, b])
    assert store.counts("celery")["dead"] == 2
    assert sorted(c for c in raising.calls if c.startswith("failed")) == sorted(
        [f"failed {a} from None", f"failed {b} from None"]
    )
    assert "the follow-up dead_lettered of" in caplog.text
    assert "the failure follow-up of" in caplog.text


def test_the_ops_sweep_records_the_failure_from_the_node_it_is_given(
    app: Celery, client: redis.Redis, prefix: str, events: list[tuple[str, str, Any]]
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    result, job_id = lapse(app, store, 1000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app, node="beat@h"))
    assert sweeper.sweep("celery", now_ms=7000).dead == [job_id]
    assert events == [("beat@h", "task-failed", result.id)]
    assert result.state == "FAILURE"


def test_the_beat_task_sends_the_signal_stores_the_failure_and_the_event(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    signalled: list[str],
    events: list[tuple[str, str, Any]],
) -> None:
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "max_stalled": 0}
    store = JobStore(client, prefix + "emq", 5000)
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    # Claimed and started long ago; sweeps have run until now (no outage).
    result, job_id = lapse(app, store, now_ms - 60_000)
    sweeps_ran_until(store, "celery", now_ms)
    reports = app.tasks[SWEEP_TASK].apply(kwargs={"queues": ["celery"]}).get()
    assert reports["celery"]["dead"] == [job_id]
    assert signalled == [f"stalled {job_id}", f"dead {job_id}"]
    with pytest.raises(StalledJobError, match=f"job {job_id}"):
        result.get(timeout=5)
    [(node, kind, task_id)] = events
    assert (kind, task_id) == ("task-failed", result.id)
    assert node  # the worker running the task (here: the eager request's host)
