"""The process-wide sweep thread: every queue this process consumes, swept on time.

A consuming channel asks :func:`sweep_thread` to :meth:`~SweepThread.watch` each
queue it consumes with its :class:`~celery_emq.transport.sweeper.Sweeper`, so
recovery needs nothing but workers. Each Redis node's queues are swept on a
lane of their own: a node that hangs delays only its own queues' sweeps.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from time import monotonic

from celery_emq.store.jobstore import JobStore
from celery_emq.store.nodes import Lanes, Share, Troubles, each_queue
from celery_emq.transport import lease
from celery_emq.transport.sweeper import Contact, Sweeper, SweepReport

__all__ = ["SweepThread", "sweep_thread"]

logger = logging.getLogger(__name__)

#: A pass for a delayed job falling due runs this long after its time (the
#: consumer that learned the time usually claims it first)...
DUE_SLACK_S = 0.2
#: ...and at least this long after the last pass.
DUE_GAP_S = 1.0
#: A queue newly watched is swept this soon (queues a consumer declares
#: together are swept in one pass).
WATCH_GAP_S = 0.05


class SweepThread:
    """Sweeps, every ``sweep_interval_s``, each queue this process consumes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, str], tuple[Sweeper, str]] = {}
        self._interval_s: float | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._due_at: float | None = None
        self._passed_at = 0.0
        self._lanes: Lanes[str] = Lanes("celery_emq-sweep")
        self._expiry: Lanes[str] = Lanes("celery_emq-expire")
        self._troubles = Troubles()
        #: This process's own record of its passes (the outage rule's evidence).
        self.contact = Contact()
        #: Queues left out of the sweep while this process's leases on them are unrenewed.
        self._unrenewed = Troubles()
        #: Queues whose own sweep fails (a slot migrating).
        self._failing = Troubles()

    def watch(self, sweeper: Sweeper, queue: str, at_once: bool = False) -> None:
        """Start sweeping ``queue`` with ``sweeper`` (idempotent per store and queue).

        ``at_once``: a queue newly watched is swept at once (queues watched
        together share that pass), as a consumer asks: that pass is the
        process's first contact on the queue, so an outage that begins once
        it consumes is seen as one (see
        :class:`~celery_emq.transport.sweeper.Contact`), and a dead fleet's
        jobs are recovered without waiting an interval.
        """
        with self._lock:
            new = (id(sweeper.store), queue) not in self._queues
            self._queues.setdefault((id(sweeper.store), queue), (sweeper, queue))
            if new and at_once:
                at = monotonic() + WATCH_GAP_S
                if self._due_at is None or at < self._due_at:
                    self._due_at = at
                    self._wake.set()
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
        :mod:`celery_emq.store.nodes`), all bounded by the sweep interval: a node
        that hangs holds up only its own queues' sweeps, so every other
        queue is swept on time (a late sweep would read as an outage and let
        stalls off). The expiry pass (``x-expires`` queues: a registry on one
        node, queues on any) runs on a lane of its own and is not waited for,
        and only when the sweep saw such queues registered (on one server the
        sweep script reads the registry's size; on a Cluster it cannot, and the
        pass runs every time).
        """
        with self._lock:
            targets = list(self._queues.values())
        if not targets:
            return []
        keeper = lease.keeper()
        try:
            keeper.renew_if_overdue(now_ms)
        except Exception as exc:
            # Each node or queue that failed was named once by the keeper.
            logger.debug("celery_emq: could not renew this process's leases (%r)", exc)
        # Within two intervals a renewed lease has not lapsed (a lease is
        # over two renewal intervals long); past that, sweeping could count
        # a stall against this process's own claim.
        unrenewed = keeper.overdue_queues(intervals=2)
        by_node: dict[str, list[tuple[Sweeper, str]]] = {}
        stores: dict[int, Sweeper] = {}
        for sweeper, queue in targets:
            stores.setdefault(id(sweeper.store), sweeper)
            if (id(sweeper.store), queue) in unrenewed:
                self._unrenewed.report(
                    queue,
                    "celery_emq: this process's leases of queue %s could not be renewed: "
                    "it is not swept until they are",
                    queue,
                )
                continue
            self._unrenewed.over(
                queue, "celery_emq: queue %s's leases renewed: swept again after %.1f s", queue
            )
            by_node.setdefault(sweeper.store.node_of(queue), []).append((sweeper, queue))
        shares = {
            node: partial(_sweep_all, items, now_ms, self.contact)
            for node, items in by_node.items()
        }
        reports: list[SweepReport] = []
        interval_s = self._interval_s or 5.0
        for node, share in self._lanes.run(shares, interval_s).items():
            if share.done:
                for (_sweeper, queue), outcome in (share.value or {}).items():
                    if outcome.value is not None:
                        reports.append(outcome.value)
                        self._failing.over(
                            queue, "celery_emq: queue %s swept again after %.1f s", queue
                        )
                    else:
                        self._failing.report(
                            queue,
                            "celery_emq: sweep of queue %s on %s failed (%r); retrying next pass",
                            queue,
                            node,
                            outcome.error,
                        )
                self._troubles.over(node, "celery_emq: %s's queues swept again after %.1f s", node)
            elif share.late and share.busy_s >= interval_s:
                self._troubles.report(
                    node,
                    "celery_emq: the sweep of %s's queues has been running for %.1f s "
                    "(the node does not answer?): they are swept again once it ends",
                    node,
                    share.busy_s,
                )
        expiring = {str(k): partial(_expire, s) for k, s in stores.items() if s.expiring}
        self._expiry.run(expiring, 0)
        return reports

    def due_in(self, seconds: float) -> None:
        """Sweep once a delayed job a consumer of this process learned of is due.

        The pass promotes it and pushes its wake marker, so a waiting consumer
        claims it on time even when the one that learned the time (its wait
        ends then) has since become busy, or closed.
        """
        at = monotonic() + max(seconds, 0.0) + DUE_SLACK_S
        with self._lock:
            at = max(at, self._passed_at + DUE_GAP_S)
            if self._due_at is None or at < self._due_at:
                self._due_at = at
                self._wake.set()

    def _run(self) -> None:
        next_pass = monotonic() + (self._interval_s or 5.0)
        while True:
            with self._lock:
                due_at = self._due_at
            deadline = next_pass if due_at is None else min(next_pass, due_at)
            self._wake.wait(max(0.0, deadline - monotonic()))
            self._wake.clear()
            now = monotonic()
            with self._lock:
                due_at = self._due_at
                due = due_at is not None and due_at <= now
                if due:
                    self._due_at = None
            if now < next_pass and not due:
                continue  # an earlier due time came in: wait for it
            # Passes stay at most an interval apart, a due one included.
            next_pass = now + (self._interval_s or 5.0)
            self._passed_at = now
            if self._queues:
                # No time given: the scripts read the Redis server's clock.
                self.run_once()


def _sweep_all(
    targets: list[tuple[Sweeper, str]], now_ms: int | None, contact: Contact
) -> dict[tuple[Sweeper, str], Share[SweepReport]]:
    """Sweep each of one node's queues; a queue whose sweep fails is tried next pass.

    On one server, one look over the queues of each store says which have
    work; only those are swept (an idle worker's pass is one call, whatever
    its queues).
    """
    by_sweeper: dict[int, tuple[Sweeper, list[str]]] = {}
    for sweeper, queue in targets:
        by_sweeper.setdefault(id(sweeper), (sweeper, []))[1].append(queue)
    idle = {
        (key, q)
        for key, (sweeper, queues) in by_sweeper.items()
        for q in sweeper.idle(queues, now_ms, contact)
    }

    def sweep(target: tuple[Sweeper, str]) -> SweepReport:
        sweeper, queue = target
        if (id(sweeper), queue) in idle:
            return SweepReport(queue)
        return sweeper.sweep(queue, now_ms, contact)

    return each_queue(targets, sweep)


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
