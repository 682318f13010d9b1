"""What follows a sweep: who hears of a stalled, recovered or dead-lettered job.

The sweep (:class:`~celery_emq.transport.sweeper.Sweeper`) moves jobs in the
store and logs what it did; what else follows belongs to the process around
the transport. Inside Celery the worker layer
(:mod:`celery_emq.worker.follow_up`) sends the signals, records a dead task's
failure (a result and a ``task-failed`` event) and says which content types
may be decoded. It registers itself with :func:`set_follow_up`; a sweep given
no follow-up uses the registered one, and a plain kombu consumer keeps
:class:`LogOnly`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from celery_emq.transport.jobs import DEFAULT_ACCEPT, JobInfo

__all__ = ["FollowUp", "LogOnly", "follow_up", "set_follow_up"]


class FollowUp(Protocol):
    """What a sweep hands each job it touched to, after it moved it.

    A method that raises is logged by the sweep and never breaks it.
    """

    def accept(self) -> frozenset[str]:
        """The content types (MIME) a job's body may be decoded from, to describe it."""

    def succeeded(self, info: JobInfo, since_ms: int | None) -> bool:
        """Whether a run of ``info``'s job is known to have succeeded (its ack was lost).

        ``since_ms``: when the job was published (the Redis server's clock), or
        ``None``; a success from before it is another task's that had the same id.
        """

    def stalled(self, info: JobInfo) -> None:
        """One stall was counted on ``info``'s job."""

    def recovered(self, info: JobInfo) -> None:
        """``info``'s job went back to the front of its queue."""

    def dead_lettered(self, info: JobInfo) -> None:
        """``info``'s job was moved to the morgue."""

    def failed(self, info: JobInfo, last_holder: Callable[[], str | None]) -> None:
        """Record the failure of a task the sweep dead-lettered (nothing else will).

        ``last_holder()`` reads the node of the worker that last held the job
        (from its stall history), or ``None``.
        """


class LogOnly:
    """No follow-up: the sweep's log lines are all; bodies are decoded from JSON only."""

    def accept(self) -> frozenset[str]:
        return DEFAULT_ACCEPT

    def succeeded(self, info: JobInfo, since_ms: int | None) -> bool:
        return False

    def stalled(self, info: JobInfo) -> None:
        pass

    def recovered(self, info: JobInfo) -> None:
        pass

    def dead_lettered(self, info: JobInfo) -> None:
        pass

    def failed(self, info: JobInfo, last_holder: Callable[[], str | None]) -> None:
        pass


_follow_up: FollowUp = LogOnly()


def follow_up() -> FollowUp:
    """The follow-up registered for this process (:class:`LogOnly` unless one was)."""
    return _follow_up


def set_follow_up(new: FollowUp) -> None:
    """Register what follows every sweep of this process that is given none."""
    global _follow_up
    _follow_up = new
