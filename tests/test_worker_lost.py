"""The worker-lost probe decides for one request and never touches the shared task object."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.worker.request import Request

from celery_emq.transport.process import WORKER_LOST
from celery_emq.worker import lost, marks


class _ExcInfo:
    def __init__(self, exc: BaseException) -> None:
        self.exception = exc
        self.traceback = ""
        self.exc_info = (type(exc), exc, None)


class _Message:
    def __init__(self, tag: str) -> None:
        self.delivery_tag = tag


class _Request:
    """Just what ``Request.on_failure`` and the probe read of a request."""

    def __init__(self, task: Any, tag: str) -> None:
        self.id = tag
        self.task = task
        self.message = _Message(tag)
        self.rejected: list[bool] = []
        self.acked = 0
        self._already_cancelled = False
        self._already_revoked = False

    def _success_was_stored(self) -> bool:
        return False

    def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)

    def acknowledge(self) -> None:
        self.acked += 1


class _Watched:
    """A task whose attribute writes are recorded."""

    def __init__(self, task: Any, writes: list[str]) -> None:
        object.__setattr__(self, "_task", task)
        object.__setattr__(self, "_writes", writes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._writes.append(name)
        setattr(self._task, name, value)

    def __delattr__(self, name: str) -> None:
        self._writes.append(name)
        delattr(self._task, name)


@pytest.fixture
def probed(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``Request.on_failure`` with the probe installed, restored afterwards."""
    monkeypatch.setattr(Request, "on_failure", Request.on_failure)
    lost.install()
    return Request.on_failure


def test_lost_process_is_requeued_marked_and_the_task_is_untouched(probed: Any) -> None:
    app = Celery("probe", set_as_current=False)

    @app.task(acks_late=True)
    def job() -> None: ...

    writes: list[str] = []
    request = _Request(_Watched(job, writes), "j1#1")
    probed(request, _ExcInfo(WorkerLostError("gone")))
    assert request.rejected == [True]
    assert request.acked == 0
    assert writes == []
    assert "reject_on_worker_lost" not in vars(job)
    mark = marks.pop_mark("j1#1")
    assert mark is not None and mark.reason == WORKER_LOST


def test_concurrent_losses_under_threads_leave_no_trace_on_the_task(probed: Any) -> None:
    app = Celery("probe", set_as_current=False)

    @app.task(acks_late=True)
    def job() -> None: ...

    writes: list[str] = []
    task = _Watched(job, writes)
    requests = [_Request(task, f"t{i}#1") for i in range(50)]
    start = threading.Barrier(len(requests))

    def fail(request: _Request) -> None:
        start.wait()
        probed(request, _ExcInfo(WorkerLostError("gone")))

    threads = [threading.Thread(target=fail, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert [r.rejected for r in requests] == [[True]] * len(requests)
    assert writes == []
    assert job.reject_on_worker_lost is None or job.reject_on_worker_lost is False
    assert all(marks.pop_mark(f"t{i}#1") is not None for i in range(len(requests)))


def test_retry_on_worker_lost_leaves_the_delivery_to_celery(
    probed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery("probe", set_as_current=False)

    @app.task(acks_late=True, retry_on_worker_lost=True)
    def job() -> None: ...

    handed: list[str] = []
    original = marks.mark

    def no_mark(message: Any, reason: str, error: str = "") -> None:
        handed.append(reason)
        original(message, reason, error)

    monkeypatch.setattr(marks, "mark", no_mark)
    request = _Request(job, "r1#1")
    # Celery's own on_failure runs (it would publish the retry): stop it at its
    # first step, which shows the probe handed the request on unmarked.
    monkeypatch.setattr(
        "celery.worker.request.task_ready",
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("celery's own handling")),
    )
    with pytest.raises(RuntimeError, match="celery's own handling"):
        probed(request, _ExcInfo(WorkerLostError("gone")))
    assert handed == []
    assert marks.pop_mark("r1#1") is None


def test_a_task_cancelled_on_connection_loss_goes_back_at_once(probed: Any, store: Any) -> None:
    from billiard.exceptions import Terminated

    from celery_emq.transport.lease import keeper

    app = Celery("probe", set_as_current=False)

    @app.task(acks_late=True)
    def job() -> None: ...

    store.enqueue("q", "a", b"{}")
    [claim] = store.claim("q", "w")
    store.start("q", "a", claim.token)
    [tag] = keeper().hold(store, "q", [(claim.id, claim.token)], 10_000)
    request = _Request(job, tag)
    request._already_cancelled = True
    # Celery leaves the message unsettled for the broker to redeliver ...
    probed(request, _ExcInfo(Terminated(9)))
    assert request.rejected == [] and request.acked == 0
    # ... so the claim goes back now instead of being renewed for ever.
    assert keeper().get(tag) is None
    row = store.job("q", "a")
    assert (row["state"], row["stalled"]) == ("pending", "0")
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
