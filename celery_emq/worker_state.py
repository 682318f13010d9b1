"""What a Celery worker in this process is running, read without importing it eagerly."""

from __future__ import annotations

import contextvars
import sys
from typing import Any

__all__ = ["install_worker_lost_probe", "lost_delivery", "started_delivery_tags"]

_lost: contextvars.ContextVar[str | None] = contextvars.ContextVar("emq_lost", default=None)


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


def lost_delivery() -> str | None:
    """Return the delivery tag whose pool process was lost, while Celery handles it."""
    return _lost.get()


def install_worker_lost_probe() -> None:
    """Let the transport see that a pool process died under a delivery.

    Celery settles a delivery whose pool process died (``WorkerLostError``) with
    an ordinary ``ack`` or ``reject``; nothing on the message says why. The probe
    wraps ``Request.on_failure`` so that, while Celery handles such a loss, the
    transport knows the delivery tag and counts a stall instead. Installed once
    per process, only inside a Celery worker.
    """
    if "celery.worker.request" not in sys.modules:
        return
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
        token = _lost.set(self.message.delivery_tag if lost else None)
        try:
            return original(self, exc_info, *args, **kwargs)
        finally:
            _lost.reset(token)

    on_failure._emq_probe = True  # type: ignore[attr-defined]
    Request.on_failure = on_failure
