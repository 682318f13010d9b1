"""The sweep: the counted, bounded recovery of stalled jobs.

:class:`Sweeper` runs ``sweep`` (or ``reap``) passes over queues, logs what
each did, then hands each job it touched to its follow-up
(:mod:`celery_emq.transport.follow_up`): inside Celery, the signals, and a
dead task's failure recorded (a ``StalledJobError`` result and a
``task-failed`` event) so nothing waits on it forever. A process-wide thread
(:mod:`celery_emq.transport.sweep_thread`) runs a sweeper for every queue the
process consumes, so recovery needs nothing but workers.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property, partial
from typing import Any

from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome, Swept, SweptOutcome
from celery_emq.transport import lease
from celery_emq.transport.follow_up import FollowUp
from celery_emq.transport.follow_up import follow_up as registered_follow_up
from celery_emq.transport.jobs import DEFAULT_ACCEPT, NEVER_STARTED, JobInfo, describe

__all__ = ["Contact", "SweepReport", "Sweeper"]

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


class Contact:
    """A sweeping process's own record of its passes: its evidence of an outage.

    The sweep's outage rule grants a lapsed lease one more only on the word of
    a caller that swept the queue before the gap (``since``: the server's
    clock at its last pass) or failed to reach Redis (``"0"``). A process with
    no pass behind it vouches for no gap: when every worker died and Redis
    stayed up, their replacement's first sweep recovers their jobs at once.
    Keyed by store prefix and queue (a failover changes a queue's node, not
    the queue).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], int | None] = {}

    def since(self, prefix: str, queue: str) -> str:
        """What this process vouches for on ``queue`` (sweep.lua's ``since_ms``)."""
        with self._lock:
            if (prefix, queue) not in self._last:
                return ""
            last = self._last[(prefix, queue)]
        return "0" if last is None else str(last)

    def met(self, prefix: str, queue: str, now_ms: int) -> None:
        """Note a pass that got through, at the server's ``now_ms``."""
        with self._lock:
            self._last[(prefix, queue)] = now_ms

    def failed(self, prefix: str, queue: str) -> None:
        """Note a pass that did not get through (a first one: this process was cut off)."""
        with self._lock:
            self._last.setdefault((prefix, queue), None)


class Sweeper:
    """Runs sweep and reap passes over one store's queues.

    Args:
        store: the job store.
        options: the transport options (budget, batch, retention).
        follow_up: what hears of each job a pass touched (and says which
            bodies may be decoded); ``None``: the one registered for this
            process (see :func:`~celery_emq.transport.follow_up.set_follow_up`).
    """

    def __init__(
        self, store: JobStore, options: EmqOptions, follow_up: FollowUp | None = None
    ) -> None:
        self.store = store
        self.options = options
        self.follow_up = follow_up if follow_up is not None else registered_follow_up()
        #: Whether the last pass saw ``x-expires`` queues registered (always so
        #: on a Cluster, where the sweep cannot read the registry).
        self.expiring = not store.one_server

    def sweep(
        self, queue: str, now_ms: int | None = None, contact: Contact | None = None
    ) -> SweepReport:
        """Count a stall on every lapsed job of ``queue``; recover or dead-letter each.

        The same script calls first promote delayed jobs that are due
        (consumers also promote them, when their wait ends at the earliest due
        time they know of), and apply the morgue's retention: an idle queue
        costs one call a pass. A job past its budget is dead-lettered unless
        the follow-up knows its task succeeded (then deleted as completed).
        ``contact`` is the sweeping process's record of its passes (the
        process's sweep thread keeps one); without it the pass cannot tell an
        outage from a dead fleet and takes any gap since the last sweep as an
        outage (beat's task, ``celery emq sweep``).
        """
        report = SweepReport(queue)
        prefix = self.store.prefix
        for _ in range(MAX_CALLS_PER_PASS):
            try:
                swept = self.store.sweep(
                    queue,
                    self.options.max_stalled,
                    "lease_expired",
                    self.options.sweep_batch,
                    now_ms,
                    max_lapsed=self.options.max_lapsed,
                    dead_max_age_ms=self.options.dead_max_age_s * 1000,
                    dead_max_size=self.options.dead_max_size,
                    registry=True,
                    verdict=partial(self._verdict, queue, "lease_expired"),
                    since="0" if contact is None else contact.since(prefix, queue),
                )
            except Exception:
                if contact is not None:
                    contact.failed(prefix, queue)
                raise
            if contact is not None and swept.now_ms is not None:
                contact.met(prefix, queue, swept.now_ms)
            if swept and swept[-1].outcome == SweptOutcome.EXPIRING:
                self.expiring = True
                swept.pop()
            elif self.store.one_server:
                self.expiring = False
            self._after(queue, swept, report, "lease_expired")
            # Jobs past their budget reach the morgue after the script applied its
            # retention (see JobStore.sweep): one more call applies it to them too.
            died = any(
                job.outcome in (SweptOutcome.DEAD, SweptOutcome.NEVER_STARTED) for job in swept
            )
            if len(swept) < self.options.sweep_batch and not died:
                break
        if report.graced:
            logger.warning(
                "celery_emq: no sweep of %s ran for over half a lease (an outage?): "
                "%d lapsed lease(s) granted one more lease, no stall counted",
                queue,
                len(report.graced),
            )
        return report

    def idle(
        self, queues: Sequence[str], now_ms: int | None = None, contact: Contact | None = None
    ) -> set[str]:
        """Which of ``queues`` need no sweep pass now, asked in one call (one server only).

        Those are recorded swept, as their pass would have been, and count as
        this process's contact on them; the others are swept one by one. On a
        Cluster, or if the look fails, none is taken as idle: each queue's own
        sweep runs (and meets the error itself).
        """
        if not queues or not self.store.one_server:
            return set()
        prefix = self.store.prefix
        since = ["0" if contact is None else contact.since(prefix, q) for q in queues]
        try:
            looked = self.store.look(
                queues,
                since,
                now_ms,
                dead_max_age_ms=self.options.dead_max_age_s * 1000,
                dead_max_size=self.options.dead_max_size,
            )
        except Exception:
            logger.debug("celery_emq: the look over %d queues failed", len(queues), exc_info=True)
            return set()
        self.expiring = looked.expiring > 0
        idle = {q for q, need in zip(queues, looked.needs, strict=True) if not need}
        if contact is not None:
            for q in idle:
                contact.met(prefix, q, looked.now_ms)
        return idle

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
        swept = self.store.charge(
            queue, job_id, token, max_stalled, reason, verdict=partial(self._verdict, queue, reason)
        )
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
        Hands the job to the follow-up's ``dead_lettered`` (inside Celery, the
        ``job_dead_lettered`` signal, with the reason); the next sweep applies
        the morgue's retention. No failure is recorded: the worker that refused
        or could not run the task does that.
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
        self._tell(self.follow_up.dead_lettered, info)
        return True

    @cached_property
    def accept(self) -> frozenset[str]:
        """Content types decoded to describe a job (inside Celery, the app's ``accept_content``)."""
        try:
            return self.follow_up.accept()
        except Exception:
            logger.exception("celery_emq: could not read the accepted content types")
            return DEFAULT_ACCEPT

    def expire(self) -> dict[str, int]:
        """Purge ``x-expires`` queues left unused past their TTL; see :meth:`JobStore.expire`."""
        return self.store.expire()

    def _after(self, queue: str, swept: list[Swept], report: SweepReport, reason: str) -> None:
        for job in swept:
            if job.outcome == SweptOutcome.PROMOTED:
                continue
            if job.outcome == SweptOutcome.TRIMMED:
                report.trimmed += 1
                continue
            if job.outcome == SweptOutcome.REQUEUED:
                report.requeued.append(job.id)
                continue
            if job.outcome == SweptOutcome.COMPLETED:
                report.completed.append(job.id)
                continue
            if job.outcome == SweptOutcome.GRACED:
                report.graced.append(job.id)
                continue
            if job.outcome == SweptOutcome.NEVER_STARTED:
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
                self._tell(self.follow_up.dead_lettered, info)
                self._tell_failed(info)
                continue
            info = describe(job.payload, queue, job.id, job.stalled, reason, accept=self.accept)
            self._tell(self.follow_up.stalled, info)
            if job.outcome == SweptOutcome.DEAD:
                report.dead.append(job.id)
                logger.error(
                    "celery_emq: %s[%s] dead-lettered from %s after %d stalls (%s)",
                    info.task_name,
                    info.task_id,
                    queue,
                    job.stalled,
                    info.reason,
                )
                self._tell(self.follow_up.dead_lettered, info)
                self._tell_failed(info)
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
                self._tell(self.follow_up.recovered, info)

    def _verdict(self, queue: str, reason: str, job: Swept, published_ms: int | None) -> bool:
        """Whether the follow-up knows that the task of a job past its budget succeeded.

        A finished task's ack can be lost with the server's last writes (a
        restart from a snapshot, a failover to a replica that lacked it; a fast
        task's start record with it): the job comes back as a claim that
        lapses, and the sweep may retire it. Its task did complete, so that is
        no failure: the store then deletes the job as completed, and nothing
        is signalled. Only a success since the job was published
        (``published_ms``) is its own: a task id may be given again.
        """
        if job.outcome == SweptOutcome.NEVER_STARTED:
            # Its body is never decoded here: it may be what kills a worker.
            info = describe(job.payload, queue, job.id, job.stalled, NEVER_STARTED)
        else:
            info = describe(job.payload, queue, job.id, job.stalled, reason, accept=self.accept)
        try:
            succeeded = self.follow_up.succeeded(info, published_ms)
        except Exception:
            logger.exception("celery_emq: could not learn whether %s succeeded", info.task_id)
            return False
        if succeeded:
            logger.warning(
                "celery_emq: %s[%s] lapsed in %s after its task succeeded (an ack the server "
                "lost?): deleted as completed, its SUCCESS result kept",
                info.task_name,
                info.task_id,
                queue,
            )
        return succeeded

    def _tell(self, event: Callable[[JobInfo], None], info: JobInfo) -> None:
        """Hand ``info`` to one of the follow-up's methods; a failing one is logged."""
        try:
            event(info)
        except Exception:
            logger.exception("celery_emq: the follow-up %s of %s failed", event.__name__, info.id)

    def _tell_failed(self, info: JobInfo) -> None:
        """Have the follow-up record the failure of a task the sweep dead-lettered."""
        try:
            self.follow_up.failed(info, partial(self.last_holder, info))
        except Exception:
            logger.exception("celery_emq: the failure follow-up of %s failed", info.id)

    def last_holder(self, info: JobInfo) -> str | None:
        """The node of the last worker that held ``info``'s job (from its stall history)."""
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
