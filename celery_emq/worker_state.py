"""What a Celery worker in this process is running, read without importing it eagerly."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["install_worker_lost_probe", "pop_lost_delivery", "started_delivery_tags"]

#: Delivery tags whose pool process died, waiting for Celery's (deferred) ack
#: or reject of them. Bounded: an entry nobody settles is forgotten eventually.
_lost: OrderedDict[str, None] = OrderedDict()
_lost_lock = threading.Lock()
_LOST_MAX = 10_000


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


def pop_lost_delivery(tag: str) -> bool:
    """Return (and forget) whether ``tag``'s pool process was lost."""
    with _lost_lock:
        return _lost.pop(tag, False) is None


def _mark_lost(tag: str) -> None:
    with _lost_lock:
        _lost[tag] = None
        while len(_lost) > _LOST_MAX:
            _lost.popitem(last=False)


def install_worker_lost_probe() -> None:
    """Let the transport see that a pool process died under a delivery.

    Celery settles a delivery whose pool process died (``WorkerLostError``) with
    an ordinary ``ack`` or ``reject``; nothing on the message says why. The probe
    wraps ``Request.on_failure`` to note the delivery tag of such a loss; when
    Celery's ack or reject of that tag reaches the transport (Celery defers it
    to the event loop), the transport counts a stall instead.

    A lost pool process is a stall, whatever ``task_reject_on_worker_lost``
    says: an ``acks_late`` task is handled as if that setting were on (Celery
    requeues and records no failure), and the transport turns the requeue into
    a counted recovery, or a dead-letter past the budget. Installed once per
    process, only inside a Celery worker.
    """
    if "celery.worker.consumer" not in sys.modules:
        return  # not inside a Celery worker
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
        _mark_lost(self.message.delivery_tag)
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
