"""Why Celery settles a delivery, and which deliveries the pool has started or surely will.

Celery settles some deliveries with an ordinary ``ack`` or ``reject`` that says
nothing of why: a pool process died under the task, the body could not be
decoded, the task is not registered. The hooks *mark* the delivery tag with a
reason; when the settle reaches the transport, it reads the mark
(:func:`pop_mark`) and counts a stall (``worker_lost``) or dead-letters the job
with that reason instead of deleting it.

A delivery handed to a pool that runs whatever it was handed is *submitted*:
its claim stays held when the channel closes (:func:`started_delivery_tags`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from celery_emq.transport.process import Mark
from celery_emq.worker import hooks

__all__ = [
    "error_text",
    "mark",
    "pop_mark",
    "settled",
    "started_delivery_tags",
    "submit",
    "submitted_job",
]

#: Marked delivery tags waiting for Celery's (possibly deferred) ack or reject.
#: Bounded: an entry nobody settles is forgotten eventually.
_marks: OrderedDict[str, Mark] = OrderedDict()
_marks_lock = threading.Lock()
MARKS_MAX = 10_000

#: Delivery tags handed to a pool that runs whatever it was handed (threads,
#: solo, gevent, eventlet): such a task runs even when the channel closes before
#: it starts, so its claim must stay held. Removed when the delivery is settled.
#: Each maps to the pool's result for a prefork job (it runs once written to a
#: child), or to None (it runs, whatever happens).
_submitted: dict[str, Any] = {}
_submitted_lock = threading.Lock()


def mark(message: Any, reason: str, error: str = "") -> None:
    """Mark ``message``'s delivery with the reason Celery is about to settle it."""
    tag = getattr(message, "delivery_tag", None)
    if tag is None:
        return
    with _marks_lock:
        _marks[tag] = Mark(reason, error)
        while len(_marks) > MARKS_MAX:
            _marks.popitem(last=False)


def pop_mark(tag: str) -> Mark | None:
    """Return (and forget) the mark on ``tag``, if Celery's handling left one."""
    with _marks_lock:
        return _marks.pop(tag, None)


def error_text(exc: Any) -> str:
    """The error a mark carries: ``Type: message``, or '' for none."""
    return f"{type(exc).__name__}: {exc}" if exc is not None else ""


def submit(tag: str, job: Any = None) -> None:
    """Note ``tag`` as handed to the pool: ``job`` is the prefork pool's result, else None."""
    with _submitted_lock:
        _submitted[tag] = job


def submitted_job(tag: str) -> Any:
    """Return the prefork pool's job handed ``tag``; None for another pool's, or none."""
    with _submitted_lock:
        return _submitted.get(tag)


def settled(tag: str) -> None:
    """Forget a delivery handed to the pool: it was acked or rejected."""
    with _submitted_lock:
        _submitted.pop(tag, None)


def started_delivery_tags() -> set[str]:
    """Return the delivery tags of tasks this worker process has started, or will.

    Started: Celery's active requests. Will start: handed to a pool that runs
    what it was handed whatever happens to the channel, or a prefork job
    written to a child. Empty outside a Celery worker.
    """
    with _submitted_lock:
        tags = {tag for tag, job in _submitted.items() if job is None or hooks.job_written(job)}
    return tags | hooks.active_delivery_tags()
