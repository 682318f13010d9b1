"""What the process around the transport tells it: the worker it runs in, if any.

The transport runs in any kombu consumer. Inside a Celery worker the worker
layer (:mod:`celery_emq.worker`) knows more: which deliveries its pool has
started, the worker's node name, why Celery is about to settle a delivery,
a task's own stall budget, and which tasks are revoked.
It tells the transport through the :class:`Host` it registers with
:func:`set_host`; a plain kombu consumer keeps the default, which knows
nothing of the kind. The layers above also ask to hear when a transport starts
in this process (:func:`on_transport_start`): the worker installs its hooks
then, and Flower support teaches Flower the ``emq://`` schemes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol

from celery_emq.errors import EmqError
from celery_emq.store.outcomes import UNSET

__all__ = [
    "WORKER_LOST",
    "Host",
    "Mark",
    "NoHost",
    "host",
    "on_transport_start",
    "set_host",
    "transport_started",
]

logger = logging.getLogger(__name__)

#: The reason that makes a settle a stall rather than a dead letter.
WORKER_LOST = "worker_lost"


class Mark(NamedTuple):
    """Why the worker is about to settle a delivery."""

    reason: str
    error: str


class Host(Protocol):
    """What the worker this transport runs in knows; every method is cheap and never raises."""

    def started_delivery_tags(self) -> set[str]:
        """The delivery tags of tasks this process has started, or surely will."""

    def nodename(self) -> str | None:
        """This worker's node name (``celery@host``), once known."""

    def claim_at_once(self) -> bool:
        """Whether a free prefetch slot is to be filled now, not together with others."""

    def pop_mark(self, tag: str) -> Mark | None:
        """Return (and forget) the mark on ``tag``, if the worker left one."""

    def settled(self, tag: str) -> None:
        """``tag`` was acked or rejected: forget what was noted of it."""

    def task_budget(self, task_name: str) -> object:
        """The ``emq_max_stalled`` attribute of the task so named, as set; ``UNSET`` if none."""

    def revoked(self, task_id: str) -> None:
        """``task_id`` was revoked while it waited in the delayed set: discard it when it comes."""

    def tasks_run_here(self) -> bool:
        """Whether a task this process started runs in it (not in a prefork child).

        Such a task can kill the process that holds its claims: it shares the
        blame with a suspect whose reception it may have cut short.
        """


class NoHost:
    """A plain kombu consumer: nothing started behind the transport's back, no marks."""

    def started_delivery_tags(self) -> set[str]:
        return set()

    def nodename(self) -> str | None:
        return None

    def claim_at_once(self) -> bool:
        return True

    def pop_mark(self, tag: str) -> Mark | None:
        return None

    def settled(self, tag: str) -> None:
        pass

    def task_budget(self, task_name: str) -> object:
        return UNSET

    def revoked(self, task_id: str) -> None:
        pass

    def tasks_run_here(self) -> bool:
        return True


_host: Host = NoHost()


def host() -> Host:
    """The host registered for this process (:class:`NoHost` unless one was)."""
    return _host


def set_host(new: Host) -> None:
    """Register what the process around the transport knows (once, at import of its layer)."""
    global _host
    _host = new


_on_start: list[Callable[[], None]] = []


def on_transport_start(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever a transport or channel starts in this process (once listed)."""
    if callback not in _on_start:
        _on_start.append(callback)


def transport_started() -> None:
    """A transport or channel starts: tell those who asked.

    A callback that fails is logged, unless it raises one of celery_emq's own
    errors (the worker's hooks missing here): that stops the start.
    """
    for callback in list(_on_start):
        try:
            callback()
        except EmqError:
            raise
        except Exception:
            logger.exception("celery_emq: %r failed as a transport started", callback)
