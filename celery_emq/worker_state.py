"""What a Celery worker in this process is doing, read without importing it eagerly.

Celery settles some deliveries with an ordinary ``ack`` or ``reject`` that says
nothing of why: a pool process died under the task, the body could not be
decoded, the task is not registered. The probes installed here wrap the Celery
methods that decide those outcomes and *mark* the delivery tag with a reason;
when the settle reaches the transport, it reads the mark and counts a stall
(``worker_lost``) or dead-letters the job with that reason instead of deleting it.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Mark", "install_worker_probes", "pop_mark", "started_delivery_tags"]

#: The reason that makes a settle a stall rather than a dead letter.
WORKER_LOST = "worker_lost"


class Mark(NamedTuple):
    """Why Celery is about to settle a delivery."""

    reason: str
    error: str


#: Marked delivery tags waiting for Celery's (possibly deferred) ack or reject.
#: Bounded: an entry nobody settles is forgotten eventually.
_marks: OrderedDict[str, Mark] = OrderedDict()
_marks_lock = threading.Lock()
_MARKS_MAX = 10_000


def started_delivery_tags() -> set[str]:
    """Return the delivery tags of tasks this worker process has started.

    Empty outside a Celery worker. Read from ``celery.worker.state`` only when
    that module is already loaded, so a plain kombu client pays nothing.
    """
    state = sys.modules.get("celery.worker.state")
    if state is None:
        return set()
    tags: set[str] = set()
    for request in list(getattr(state, "active_requests", ())):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag is not None:
            tags.add(tag)
    return tags


def pop_mark(tag: str) -> Mark | None:
    """Return (and forget) the mark on ``tag``, if Celery's handling left one."""
    with _marks_lock:
        return _marks.pop(tag, None)


def _mark(message: Any, reason: str, error: str = "") -> None:
    tag = getattr(message, "delivery_tag", None)
    if tag is None:
        return
    with _marks_lock:
        _marks[tag] = Mark(reason, error)
        while len(_marks) > _MARKS_MAX:
            _marks.popitem(last=False)


def _error(exc: Any) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else ""


def _wrap(cls: Any, name: str, before: Callable[..., None]) -> None:
    """Call ``before(self, *args)`` ahead of ``cls.name``; once per process."""
    original = getattr(cls, name)
    if getattr(original, "_emq_probe", False):
        return

    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        before(self, *args)
        return original(self, *args, **kwargs)

    probe._emq_probe = True  # type: ignore[attr-defined]
    setattr(cls, name, probe)


def install_worker_probes() -> None:
    """Install the probes, once per process, and only inside a Celery worker.

    A lost pool process is a stall, whatever ``task_reject_on_worker_lost``
    says: an ``acks_late`` task is handled as if that setting were on (Celery
    requeues and records no failure), and the transport turns the requeue into
    a counted recovery, or a dead-letter past the budget. A message Celery
    cannot decode (it would ack it away) or will not run (an unknown or invalid
    task, which it rejects) is dead-lettered with that reason.
    """
    if "celery.worker.consumer" not in sys.modules:
        return  # not inside a Celery worker
    from celery.worker.consumer.consumer import Consumer

    _wrap(
        Consumer,
        "on_decode_error",
        lambda self, message, exc: _mark(message, "malformed", _error(exc)),
    )
    _wrap(
        Consumer,
        "on_unknown_message",
        lambda self, body, message: _mark(message, "unknown_message"),
    )
    _wrap(
        Consumer,
        "on_unknown_task",
        lambda self, body, message, exc: _mark(message, "unknown_task", _error(exc)),
    )
    _wrap(
        Consumer,
        "on_invalid_task",
        lambda self, body, message, exc: _mark(message, "invalid_task", _error(exc)),
    )
    _install_worker_lost_probe()


def _install_worker_lost_probe() -> None:
    from billiard.exceptions import WorkerLostError
    from celery.worker.request import Request

    if getattr(Request.on_failure, "_emq_probe", False):
        return
    original = Request.on_failure

    def on_failure(self: Any, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        lost = isinstance(exc, WorkerLostError) or (
            isinstance(exc, SystemExit | KeyboardInterrupt)
            and not getattr(self, "_already_cancelled", False)
            and not getattr(self, "_already_revoked", False)
        )
        if lost:
            success_was_stored = getattr(self, "_success_was_stored", None)
            if success_was_stored is not None and success_was_stored():
                lost = False  # it finished before its process died: a plain ack
        task = self.task
        if not lost or not task.acks_late:
            return original(self, exc_info, *args, **kwargs)
        had_own = "reject_on_worker_lost" in vars(task)
        own = vars(task).get("reject_on_worker_lost")
        _mark(self.message, WORKER_LOST, _error(exc))
        task.reject_on_worker_lost = True
        try:
            return original(self, exc_info, *args, **kwargs)
        finally:
            if had_own:
                task.reject_on_worker_lost = own
            else:
                del task.reject_on_worker_lost

    on_failure._emq_probe = True  # type: ignore[attr-defined]
    Request.on_failure = on_failure
