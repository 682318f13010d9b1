"""The sweep: the counted, bounded recovery of stalled jobs, and what follows it.

:class:`Sweeper` runs ``sweep`` (or ``reap``) passes over queues, then hands each
job it touched to the signals; a dead-lettered job's task is also recorded as
failed (a ``StalledJobError`` result and a ``task-failed`` event) so nothing
waits on it forever. A process-wide thread runs a sweeper for every queue the
process consumes, so recovery needs nothing but workers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property, partial
from typing import Any

from celery import states
from celery.backends.rpc import RPCBackend

from celery_emq.errors import StalledJobError
from celery_emq.options import EmqOptions
from celery_emq.signals import job_dead_lettered, job_recovered, job_stalled
from celery_emq.store.jobstore import PROMOTE_BATCH, JobStore
from celery_emq.store.nodes import Lanes, Troubles
from celery_emq.store.scripts import Outcome, Swept
from celery_emq.transport import lease
from celery_emq.transport.jobs import NEVER_STARTED, JobInfo, accepted_content, describe
from celery_emq.transport.process import host

__all__ = ["SweepReport", "Sweeper", "sweep_thread"]

logger = logging.getLogger(__name__)

#: Most script calls one pass makes per queue, so a pass is bounded in time.
MAX_CALLS_PER_PASS = 100


@dataclass
class SweepReport:
    """What one pass over one queue did."""

    queue: str
    recovered: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    reaped: list[str] = field(default_factory=list)
    #: Lapsed before their task started: back in line, no stall counted.
    requeued: list[str] = field(default_factory=list)
    #: Lapsed after an older claim of theirs had completed: deleted as done.
    completed: list[str] = field(default_factory=list)
    #: Lapsed in an outage (no sweep ran for over half a lease): one more lease, uncounted.
    graced: list[str] = field(default_factory=list)
    trimmed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-friendly dict."""
        return asdict(self)


class Sweeper:
    """Runs sweep and reap passes over one store's queues.

    Args:
        store: the job store.
        options: the transport options (budget, batch, retention).
        app: the Celery app whose result backend and events record a
            dead-lettered task; ``None`` uses the current app when one exists.
    """

    def __init__(
        self, store: JobStore, options: EmqOptions, app: Any = None, node: str | None = None
    ) -> None:
        self.store = store
        self.options = options
        self.app = app
        #: The Celery node a dead task's ``task-failed`` event is sent from
        #: (the worker running the sweep); see :meth:`_failure_node`.
        self.node = node

    def sweep(self, queue: str, now_ms: int | None = None) -> SweepReport:
        """Count a stall on every lapsed job of ``queue``; recover or dead-letter each.

        Delayed jobs that are due are promoted first (consumers also promote
        them, at least once a second, whenever they look for work). The same
        script calls apply the morgue's retention, on every pass.
        """
        report = SweepReport(queue)
        for _ in range(MAX_CALLS_PER_PASS):
            if self.store.promote(queue, now_ms=now_ms) < PROMOTE_BATCH:
                break
        for _ in range(MAX_CALLS_PER_PASS):
            swept = self.store.sweep(
                queue,
                self.options.max_stalled,
                "lease_expired",
                self.options.sweep_batch,
                now_ms,
                max_lapsed=self.options.max_lapsed,
                dead_max_age_ms=self.options.dead_max_age_s * 1000,
                dead_max_size=self.options.dead_max_size,
            )
            self._after(queue, swept, report, "lease_expired")
            if len(swept) < self.options.sweep_batch:
                break
        if report.graced:
            logger.warning(
                "celery_emq: no sweep of %s ran for over half a lease (an outage?): "
                "%d lapsed lease(s) granted one more lease, no stall counted",
                queue,
                len(report.graced),
            )
        return report

    def reap(self, queue: str, now_ms: int | None = None) -> SweepReport:
        """Return every lapsed job of ``queue`` to its queue, uncounted."""
        report = SweepReport(queue)
        for _ in range(MAX_CALLS_PER_PASS):
            reaped = self.store.reap(queue, self.options.sweep_batch, now_ms)
            report.reaped.extend(reaped)
            if len(reaped) < self.options.sweep_batch:
                break
        return report

    def run(self, queues: Sequence[str] = (), reap: bool = False) -> list[SweepReport]:
        """One pass, as beat's task and ``celery emq sweep`` run it.

        Sweeps (or reaps) ``queues``, or every registered task queue; then
        drops registered queues that never held leased work and expires
        unused ``x-expires`` queues.
        """
        names = list(queues) or self.store.queues()
        run = self.reap if reap else self.sweep
        reports = [run(q) for q in names]
        if not queues:
            self.store.unregister_unused(names)
        self.expire()
        return reports

    def charge(
        self, queue: str, job_id: str, token: str, reason: str, max_stalled: int | None
    ) -> Swept | None:
        """Count one stall on a live claim whose pool process died (fenced by ``token``)."""
        swept = self.store.charge(queue, job_id, token, max_stalled, reason)
        if swept is None:
            logger.warning(
                "celery_emq: stall of job %s in %s (claim %s) not charged: that claim is "
                "no longer the job's live claim (settled, or fenced by another)",
                job_id,
                queue,
                token,
            )
        else:
            report = SweepReport(queue)
            self._after(queue, [swept], report, reason)
        return swept

    def bury(self, queue: str, job_id: str, token: str, reason: str, error: str) -> bool:
        """Dead-letter one job that cannot or will not run; return whether it moved.

        Fenced by the claim's ``token``: a newer claim of the job is left alone.
        Sends ``job_dead_lettered`` with the reason (the next sweep applies the
        morgue's retention). (Celery itself records the task's failure in these
        cases.)
        """
        outcome = self.store.bury(queue, job_id, token, reason, error)
        if outcome is not Outcome.OK:
            logger.warning(
                "celery_emq: job %s in %s not dead-lettered (%s): %s",
                job_id,
                queue,
                reason,
                outcome.name,
            )
            return False
        row = self.store.job(queue, job_id)
        info = describe(
            row.get("payload", ""),
            queue,
            job_id,
            int(row.get("stalled", 0)),
            reason,
            accept=self.accept,
        )
        logger.error(
            "celery_emq: job %s dead-lettered from %s: %s %s", job_id, queue, reason, error
        )
        _send(job_dead_lettered, info)
        return True

    @cached_property
    def accept(self) -> frozenset[str]:
        """Content types decoded to describe a job: the app's ``accept_content``."""
        return accepted_content(self.app or _current_app())

    def expire(self) -> dict[str, int]:
        """Purge ``x-expires`` queues left unused past their TTL; see :meth:`JobStore.expire`."""
        return self.store.expire()

    def _after(self, queue: str, swept: list[Swept], report: SweepReport, reason: str) -> None:
        for job in swept:
            if job.outcome == "trimmed":
                report.trimmed += 1
                continue
            if job.outcome == "requeued":
                report.requeued.append(job.id)
                continue
            if job.outcome == "completed":
                report.completed.append(job.id)
                continue
            if job.outcome == "graced":
                report.graced.append(job.id)
                continue
            if job.outcome == NEVER_STARTED:
                # Its body is never decoded here: it may be what kills a worker.
                info = describe(job.payload, queue, job.id, job.stalled, NEVER_STARTED)
                report.dead.append(job.id)
                logger.error(
                    "celery_emq: %s[%s] dead-lettered from %s: its lease lapsed before "
                    "its task started more than max_lapsed=%s times (never_started)",
                    info.task_name,
                    info.task_id,
                    queue,
                    self.options.max_lapsed,
                )
                _send(job_dead_lettered, info)
                self._record_failure(info)
                continue
            info = describe(job.payload, queue, job.id, job.stalled, reason, accept=self.accept)
            if job.outcome == "dead" and self._succeeded(info):
                self._forget_succeeded(info)
                report.completed.append(job.id)
                continue
            _send(job_stalled, info)
            if job.outcome == "dead":
                report.dead.append(job.id)
                logger.error(
                    "celery_emq: %s[%s] dead-lettered from %s after %d stalls (%s)",
                    info.task_name,
                    info.task_id,
                    queue,
                    job.stalled,
                    info.reason,
                )
                _send(job_dead_lettered, info)
                self._record_failure(info)
            else:
                report.recovered.append(job.id)
                logger.warning(
                    "celery_emq: %s[%s] recovered to %s (stall %d, %s)",
                    info.task_name,
                    info.task_id,
                    queue,
                    job.stalled,
                    info.reason,
                )
                _send(job_recovered, info)

    def _succeeded(self, info: JobInfo) -> bool:
        """Whether the result backend already holds a SUCCESS for ``info``'s task.

        A finished task's ack can be lost with the server's last writes (a
        restart from a snapshot, a failover to a replica that lacked it): the
        job comes back as a started claim that lapses, and the sweep may retire
        it. Its task did complete, so that is no failure.
        """
        app = self.app or _current_app()
        if app is None or not info.task_id:
            return False
        try:
            backend = app.backend
            if _is_disabled(backend) or isinstance(backend, RPCBackend):
                # An RPC result travels to its caller's reply queue: none to read here.
                return False
            return bool(backend.get_task_meta(info.task_id).get("status") == states.SUCCESS)
        except Exception:
            logger.exception("celery_emq: could not read the result of %s", info.task_id)
            return False

    def _forget_succeeded(self, info: JobInfo) -> None:
        """Take a retired job whose task succeeded out of the morgue; send nothing."""
        logger.warning(
            "celery_emq: %s[%s] lapsed in %s after its task succeeded (an ack the server "
            "lost?): deleted as completed, its SUCCESS result kept",
            info.task_name,
            info.task_id,
            info.queue,
        )
        try:
            self.store.purge_dead(info.queue, [info.id])
        except Exception:
            logger.exception("celery_emq: could not delete completed job %s", info.id)

    def _record_failure(self, info: JobInfo) -> None:
        """Store a StalledJobError result and send ``task-failed`` for a dead task."""
        app = self.app or _current_app()
        if app is None or not info.task_id:
            return
        cause = (
            "its lease lapsed again and again before it started"
            if info.reason == NEVER_STARTED
            else f"stalled {info.stalled} times"
        )
        exc = StalledJobError(
            f"{info.task_name}[{info.task_id}] dead-lettered from {info.queue} as job "
            f"{info.id}: {cause} ({info.reason})",
            info.id,
            info.queue,
            info.stalled,
            info.reason,
        )
        try:
            backend = app.backend
            if not _is_disabled(backend) and not info.headers.get("ignore_result"):
                backend.mark_as_failure(info.task_id, exc, call_errbacks=False)
        except Exception:
            logger.exception("celery_emq: could not store the failure of %s", info.task_id)
        node = self._failure_node(info)
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

    def _failure_node(self, info: JobInfo) -> str | None:
        """The real worker a dead task's failure is reported from, or ``None``.

        The worker running this sweep (given, or this process's consuming
        worker), else the worker that last held the job (from its stall
        history). Never a made-up node: Flower would list it as a worker.
        """
        node = self.node or host().nodename()
        if node:
            return node
        try:
            raw = self.store.client.hget(self.store.keys(info.queue).job(info.id), "history")
            history = json.loads(raw) if raw else []
        except Exception:
            return None
        for entry in reversed(history if isinstance(history, list) else []):
            owner = entry.get("owner") if isinstance(entry, dict) else None
            if isinstance(owner, str) and (found := lease.owner_node(owner)):
                return found
        return None


def _send(signal: Any, info: JobInfo) -> None:
    # Celery's Signal.send logs a raising handler and goes on; never let one
    # break the sweep even if that changes.
    try:
        signal.send(sender=info.task_name, job=info)
    except Exception:
        logger.exception("celery_emq: a %s handler failed", signal.name)


def _is_disabled(backend: Any) -> bool:
    return type(backend).__name__ == "DisabledBackend"


def _current_app() -> Any:
    from celery._state import get_current_app

    try:
        return get_current_app()
    except Exception:
        return None


class SweepThread:
    """Sweeps, every ``sweep_interval_s``, each queue this process consumes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, str], tuple[Sweeper, str]] = {}
        self._interval_s: float | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._lanes: Lanes[str] = Lanes("celery_emq-sweep")
        self._expiry: Lanes[str] = Lanes("celery_emq-expire")
        self._troubles = Troubles()

    def watch(self, sweeper: Sweeper, queue: str) -> None:
        """Start sweeping ``queue`` with ``sweeper`` (idempotent per store and queue)."""
        with self._lock:
            self._queues.setdefault((id(sweeper.store), queue), (sweeper, queue))
            interval = sweeper.options.sweep_interval_s
            if self._interval_s is None or interval < self._interval_s:
                self._interval_s = interval
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery_emq-sweeper", daemon=True
                )
                self._thread.start()

    def unwatch_store(self, store: JobStore) -> None:
        """Stop sweeping every queue of ``store``."""
        with self._lock:
            for key in [k for k in self._queues if k[0] == id(store)]:
                del self._queues[key]

    def run_once(self, now_ms: int | None = None) -> list[SweepReport]:
        """Sweep every watched queue once, node by node; then start the expiry pass.

        The leases this process holds are renewed first if their renewal is
        overdue (see :meth:`LeaseKeeper.renew_if_overdue`): a process that was
        held up longer than a lease counts no stall against its own live claims.
        The queues of a node whose leases of this process could not be renewed
        are skipped this pass.

        Each node's queues are swept on that node's lane (see
        :mod:`celery_emq.nodes`), all bounded by the sweep interval: a node
        that hangs holds up only its own queues' sweeps, so every other
        queue is swept on time (a late sweep would read as an outage and let
        stalls off). The expiry pass (``x-expires`` queues: a registry on one
        node, queues on any) runs on a lane of its own and is not waited for.
        """
        with self._lock:
            targets = list(self._queues.values())
        if not targets:
            return []
        keeper = lease.keeper()
        try:
            keeper.renew_if_overdue(now_ms)
        except Exception as exc:
            logger.warning("celery_emq: could not renew this process's leases (%r)", exc)
        # Within two intervals a renewed lease has not lapsed (a lease is
        # over two renewal intervals long); past that, sweeping could count
        # a stall against this process's own claim.
        unrenewed = keeper.overdue_nodes(intervals=2)
        by_node: dict[str, list[tuple[Sweeper, str]]] = {}
        stores: dict[int, Sweeper] = {}
        for sweeper, queue in targets:
            stores.setdefault(id(sweeper.store), sweeper)
            by_node.setdefault(sweeper.store.node_of(queue), []).append((sweeper, queue))
        for node in sorted(unrenewed & set(by_node)):
            self._troubles.report(
                node,
                "celery_emq: this process's leases on %s could not be renewed: "
                "its queues are not swept until they are",
                node,
            )
            del by_node[node]
        shares = {node: partial(_sweep_all, items, now_ms) for node, items in by_node.items()}
        reports: list[SweepReport] = []
        interval_s = self._interval_s or 5.0
        for node, share in self._lanes.run(shares, interval_s).items():
            if share.done:
                reports.extend(share.value or [])
                self._troubles.over(node, "celery_emq: %s's queues swept again after %.1f s", node)
            elif share.late and share.busy_s >= interval_s:
                self._troubles.report(
                    node,
                    "celery_emq: the sweep of %s's queues has been running for %.1f s "
                    "(the node does not answer?): they are swept again once it ends",
                    node,
                    share.busy_s,
                )
        self._expiry.run(
            {str(key): partial(_expire, sweeper) for key, sweeper in stores.items()}, 0
        )
        return reports

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s or 5.0)
            self._wake.clear()
            if self._queues:
                # No time given: the scripts read the Redis server's clock.
                self.run_once()


def _sweep_all(targets: list[tuple[Sweeper, str]], now_ms: int | None) -> list[SweepReport]:
    """Sweep each of one node's queues; a queue whose sweep fails is tried next pass."""
    reports = []
    for sweeper, queue in targets:
        try:
            reports.append(sweeper.sweep(queue, now_ms))
        except Exception:
            logger.exception("celery_emq: sweep of %s failed; retrying next pass", queue)
    return reports


def _expire(sweeper: Sweeper) -> None:
    try:
        sweeper.expire()
    except Exception:
        logger.exception("celery_emq: expiry pass failed; retrying next pass")


_sweep_thread: SweepThread | None = None
_lock = threading.Lock()


def sweep_thread() -> SweepThread:
    """Return the process-wide sweep thread."""
    global _sweep_thread
    with _lock:
        if _sweep_thread is None:
            _sweep_thread = SweepThread()
        return _sweep_thread


def _after_fork_in_child() -> None:
    global _sweep_thread, _lock
    _sweep_thread = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
