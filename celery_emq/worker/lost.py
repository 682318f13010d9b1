"""A pool process lost under its task: the delivery is requeued, marked, and charged a stall.

A lost pool process is a stall, whatever ``task_reject_on_worker_lost`` says:
an ``acks_late`` task's delivery is requeued as that setting would (no failure
is recorded), and the transport turns the marked requeue into a counted
recovery, or a dead-letter past the budget; with ``task_retry_on_worker_lost``
Celery's own retry decides instead. The shared task object is never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from billiard.exceptions import WorkerLostError

from celery_emq.transport.lease import keeper
from celery_emq.transport.process import WORKER_LOST
from celery_emq.worker import hooks, marks

__all__ = ["install", "on_failure"]


def on_failure(request: Any, exc_info: Any, celerys_own: Callable[[], Any]) -> Any:
    """Decide a failed request's settle; ``celerys_own()`` runs Celery's ``on_failure``."""
    exc = getattr(exc_info, "exception", None)
    exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
    cancelled = hooks.already_cancelled(request)
    lost = isinstance(exc, WorkerLostError) or (
        isinstance(exc, SystemExit | KeyboardInterrupt)
        and not cancelled
        and not hooks.already_revoked(request)
    )
    task = request.task
    if cancelled and task.acks_late:
        # Celery cancelled the task because the broker connection was lost,
        # and leaves the message unsettled for the broker to redeliver: let
        # the claim go back now rather than keep it renewed for ever.
        try:
            return celerys_own()
        finally:
            keeper().release(request.message.delivery_tag)
    if not lost or not task.acks_late or getattr(task, "retry_on_worker_lost", False):
        # With retry_on_worker_lost Celery publishes a retry and acks this
        # delivery: its retries (max_retries) bound the task, not the stall
        # budget, so the ack stays a plain ack.
        return celerys_own()
    if hooks.success_was_stored(request):
        return celerys_own()  # it finished: a plain ack
    # What Celery does with reject_on_worker_lost, done for this request
    # alone. The requeue reaches the transport marked, and becomes a counted
    # stall.
    hooks.task_ready(request)
    marks.mark(request.message, WORKER_LOST, marks.error_text(exc))
    request.reject(requeue=True)
    return None


def install() -> None:
    """Route Celery's ``Request.on_failure`` through :func:`on_failure` (once per process)."""
    hooks.wrap_on_failure(on_failure)
