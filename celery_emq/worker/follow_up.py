"""The sweep's follow-up in Celery: the signals, a dead task's result and event.

Whatever process runs a sweep (a worker's sweep thread, the
``celery_emq.sweep`` task, ``celery emq sweep``), :class:`CeleryFollowUp`
sends :mod:`celery_emq.signals` for each job it touched. A task the sweep
dead-lettered is also recorded as failed (a ``StalledJobError`` result and a
``task-failed`` event), so nothing waits on it for ever; one whose SUCCESS
result is already stored (its ack was lost) is no failure.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import current_app, states
from celery.utils.dispatch import Signal

from celery_emq.errors import StalledJobError
from celery_emq.signals import job_dead_lettered, job_recovered, job_stalled
from celery_emq.transport.follow_up import set_follow_up
from celery_emq.transport.jobs import NEVER_STARTED, JobInfo, accepted_content
from celery_emq.transport.process import host

__all__ = ["CLOCK_SKEW_MS", "CeleryFollowUp", "register"]

logger = logging.getLogger(__name__)

#: How much earlier than a job's publish a SUCCESS may say it completed and still be
#: taken for this job's: the worker's clock and the Redis server's may disagree a
#: little (hosts kept by NTP, by a few ms). An earlier SUCCESS is an earlier task that
#: was given the same task id.
CLOCK_SKEW_MS = 1000


class CeleryFollowUp:
    """Signals, results and events of a Celery app for what a sweep did.

    Args:
        app: the Celery app whose ``accept_content``, result backend and
            events are used; ``None`` uses the current app.
        node: the Celery node a dead task's ``task-failed`` event is sent
            from (the worker running the sweep); ``None``: this process's
            worker, else the worker that last held the job.
    """

    def __init__(self, app: Any = None, node: str | None = None) -> None:
        self._app = app
        self.node = node

    @property
    def app(self) -> Any:
        """The app given, else Celery's current app."""
        return self._app if self._app is not None else current_app

    def accept(self) -> frozenset[str]:
        return accepted_content(self.app)

    def stalled(self, info: JobInfo) -> None:
        _send(job_stalled, info)

    def recovered(self, info: JobInfo) -> None:
        _send(job_recovered, info)

    def dead_lettered(self, info: JobInfo) -> None:
        _send(job_dead_lettered, info)

    def succeeded(self, info: JobInfo, since_ms: int | None = None) -> bool:
        """Whether the result backend holds a SUCCESS of ``info``'s job.

        A finished task's ack can be lost with the server's last writes (a
        restart from a snapshot, a failover to a replica that lacked it): the
        job comes back as a started claim that lapses, and the sweep may retire
        it. Its task did complete, so that is no failure.

        A caller may give a task id of its own and give it again: a SUCCESS
        completed (``date_done``, the worker's clock) more than
        :data:`CLOCK_SKEW_MS` before ``since_ms`` (the job's publish, the Redis
        server's clock) is an earlier task's, not this job's. A result that
        says no completion time is taken at its word.
        """
        if not info.task_id:
            return False
        try:
            backend = self.app.backend
            if _is_disabled(backend) or _is_rpc(backend):
                # An RPC result travels to its caller's reply queue: none to read here.
                return False
            # Not the process's cache of ready results: it may hold an earlier task's.
            meta = backend.get_task_meta(info.task_id, cache=False)
            if meta.get("status") != states.SUCCESS:
                return False
            done_ms = _epoch_ms(meta.get("date_done"))
            return since_ms is None or done_ms is None or done_ms >= since_ms - CLOCK_SKEW_MS
        except Exception:
            logger.exception("celery_emq: could not read the result of %s", info.task_id)
            return False

    def failed(self, info: JobInfo, last_holder: Callable[[], str | None]) -> None:
        """Store a StalledJobError result and send ``task-failed`` for a dead task."""
        if not info.task_id:
            return
        app = self.app
        exc = stalled_error(info)
        try:
            backend = app.backend
            # An RPC backend sends a result to the reply queue of the task it runs
            # under (here none, or a sweep task's): never to this task's caller.
            stored = not _is_disabled(backend) and not _is_rpc(backend)
            if stored and not info.headers.get("ignore_result"):
                backend.mark_as_failure(info.task_id, exc, call_errbacks=False)
        except Exception:
            logger.exception("celery_emq: could not store the failure of %s", info.task_id)
        node = self.failure_node(last_holder)
        if node is None:
            logger.info(
                "celery_emq: no worker to report the failure of %s from (sent no task-failed)",
                info.task_id,
            )
            return
        try:
            with app.events.default_dispatcher(hostname=node) as dispatcher:
                dispatcher.send(
                    "task-failed",
                    uuid=info.task_id,
                    exception=repr(exc),
                    traceback="",
                )
        except Exception:
            logger.exception("celery_emq: could not send task-failed for %s", info.task_id)

    def failure_node(self, last_holder: Callable[[], str | None]) -> str | None:
        """The real worker a dead task's failure is reported from, or ``None``.

        The worker running this sweep (given, or this process's consuming
        worker), else the worker that last held the job. Never a made-up
        node: Flower would list it as a worker.
        """
        return self.node or host().nodename() or last_holder()


def _epoch_ms(date_done: Any) -> int | None:
    """A result's ``date_done`` (a datetime, or its ISO text) in ms since the epoch."""
    try:
        when = date_done if isinstance(date_done, datetime) else datetime.fromisoformat(date_done)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # a naive time is UTC (the database backend's)
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000)


def stalled_error(info: JobInfo) -> StalledJobError:
    """The error a task the sweep dead-lettered failed with; its text names the job."""
    cause = (
        "its lease lapsed again and again before it started"
        if info.reason == NEVER_STARTED
        else f"stalled {info.stalled} times"
    )
    return StalledJobError(
        f"{info.task_name}[{info.task_id}] dead-lettered from {info.queue} as job "
        f"{info.id}: {cause} ({info.reason})",
        info.id,
        info.queue,
        info.stalled,
        info.reason,
    )


def register() -> None:
    """Make every sweep of this process given no follow-up use Celery's current app."""
    set_follow_up(CeleryFollowUp())


def _send(signal: Signal, info: JobInfo) -> None:
    # Celery's Signal.send logs a raising handler and goes on; never let one
    # break the sweep even if that changes.
    try:
        signal.send(sender=info.task_name, job=info)
    except Exception:
        logger.exception("celery_emq: a %s handler failed", signal.name)


def _is_disabled(backend: Any) -> bool:
    return type(backend).__name__ == "DisabledBackend"


def _is_rpc(backend: Any) -> bool:
    # An RPC backend's module is loaded once there is one: importing it only
    # to ask would weigh on every import of the package.
    rpc = sys.modules.get("celery.backends.rpc")
    return rpc is not None and isinstance(backend, rpc.RPCBackend)
