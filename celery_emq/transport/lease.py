"""Lease renewal: one thread per process renews every claim the process holds.

The keeper is process-wide, not per channel, so a lease outlives the channel
that claimed it: after a broker reconnect the new channel claims under the same
:func:`worker_identity`, and deliveries of the old channel that are still
running keep their leases and can still be acked.

What a claim is, and how it is named, is :mod:`celery_emq.transport.claims`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

from celery_emq.store.nodes import Lanes, Share, Troubles, each_queue
from celery_emq.store.scripts import Outcome
from celery_emq.transport.claims import (
    TAG_SEP,
    Claim,
    delivery_tag,
    owner_node,
    parse_tag,
    worker_identity,
)
from celery_emq.transport.process import host

if TYPE_CHECKING:
    from celery_emq.store.jobstore import JobStore

__all__ = [
    "TAG_SEP",
    "Claim",
    "LeaseKeeper",
    "delivery_tag",
    "keeper",
    "owner_node",
    "parse_tag",
    "worker_identity",
]

logger = logging.getLogger(__name__)

_keeper: LeaseKeeper | None = None
_lock = threading.Lock()

#: A queue of a store, as the keeper groups its claims: (id(store), queue name).
QueueOf = tuple[int, str]

#: How long a claim kept for a task the worker never heard of is held before it
#: is let go (see LeaseKeeper.let_go_of_orphans): long enough for any accept
#: message in flight, and for most tasks such a pool process may still run.
ORPHAN_AFTER_S = 300.0


def keeper() -> LeaseKeeper:
    """Return the process-wide lease keeper."""
    global _keeper
    with _lock:
        if _keeper is None:
            _keeper = LeaseKeeper(worker_identity())
        return _keeper


def _after_fork_in_child() -> None:
    # A forked child inherits neither the renewal thread nor the right to
    # renew its parent's leases: it starts with a fresh identity and keeper.
    global _keeper, _lock
    _keeper = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LeaseKeeper:
    """Holds the claims of one process and renews their leases from a daemon thread.

    Args:
        owner: the identity every claim of this process is made under.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._held: dict[str, Claim] = {}
        self._lost: set[str] = set()
        # Claims whose task finished but whose ack could not reach Redis: still
        # renewed, and acked again on every pass until one gets through.
        self._owed: set[str] = set()
        # Claims kept at a channel close because a pool process had started
        # their task, though this worker had not heard of it (when): see
        # let_go_of_orphans.
        self._unseen: dict[str, float] = {}
        self._interval_ms: int | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: When each node's last renewal that succeeded began (monotonic
        #: seconds), by node (``JobStore.node_of``).
        self._node_renewed_at: dict[str, float] = {}
        #: When each queue's last renewal that succeeded began, by (id(store), queue).
        self._renewed_at: dict[QueueOf, float] = {}
        #: Failed renewals in a row, per queue ("<queue> on <node>").
        self._failures: dict[str, int] = {}
        self._lanes: Lanes[str] = Lanes("celery_emq-renew")
        #: Nodes whose renewals are late: reported once, and once when over.
        self._late = Troubles(every_s=float("inf"))
        self.renewals = 0
        self.pass_late = False
        #: When the last pass began (monotonic seconds).
        self._pass_began = float("-inf")

    def hold(
        self,
        store: JobStore,
        queue: str,
        claims: list[tuple[str, str]],
        interval_ms: int,
    ) -> list[str]:
        """Start renewing ``claims`` ``(id, token)`` of ``queue``; return their delivery tags."""
        tags = []
        with self._lock:
            for job_id, token in claims:
                tag = delivery_tag(job_id, token)
                self._held[tag] = Claim(store, queue, job_id, token)
                self._lost.discard(tag)
                tags.append(tag)
            if self._interval_ms is None or interval_ms < self._interval_ms:
                self._interval_ms = interval_ms
                self._wake.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery_emq-lease-keeper", daemon=True
                )
                self._thread.start()
        return tags

    def forget(self, tag: str) -> Claim | None:
        """Stop renewing a claim (settled); return it, or ``None`` if not held."""
        with self._lock:
            self._lost.discard(tag)
            self._owed.discard(tag)
            return self._held.pop(tag, None)

    def owe_acks(self, claims: list[Claim]) -> None:
        """Hold finished claims whose ack failed; ack them again on every pass.

        Their leases stay renewed meanwhile, so a task that finished while Redis
        was unreachable is neither counted as a stall nor run again.
        """
        with self._lock:
            for c in claims:
                tag = delivery_tag(c.job_id, c.token)
                self._held[tag] = c
                self._owed.add(tag)
                self._unseen.pop(tag, None)  # it finished: its ack settles it
        self._wake.set()

    def owed_count(self, prefix: str = "") -> int:
        """Return how many finished claims wait for their ack to get through.

        Only those of stores whose key prefix starts with ``prefix``, when given.
        """
        with self._lock:
            if not prefix:
                return len(self._owed)
            held = [self._held.get(t) for t in self._owed]
            return sum(1 for c in held if c is not None and c.store.prefix.startswith(prefix))

    def _settle_owed(self, claims: list[Claim]) -> int:
        """Ack one queue's ``claims`` whose ack failed before; return how many went through."""
        first = claims[0]
        first.store.ack_many(first.queue, [(c.job_id, c.token) for c in claims])
        with self._lock:
            for c in claims:
                tag = delivery_tag(c.job_id, c.token)
                self._owed.discard(tag)
                self._held.pop(tag, None)
        logger.info("celery_emq: %d deferred ack(s) went through", len(claims))
        return len(claims)

    def release(self, tag: str, unless_started: bool = False, unseen: bool = False) -> None:
        """Put a held claim back at the front of its queue, uncounted.

        The claim is forgotten first, so a release that fails (Redis
        unreachable) leaves nothing renewed for ever: its lease lapses and the
        sweep puts the job back. With ``unless_started``, a claim whose task
        has started stays held, renewed until its task settles it; ``unseen``
        says the worker had not heard that it started (see
        :meth:`let_go_of_orphans`).
        """
        claim = self.forget(tag)
        if claim is None:
            return
        try:
            outcome = claim.store.release(claim.queue, claim.job_id, claim.token, unless_started)
        except Exception as exc:
            logger.warning("celery_emq: could not release %s (%r); its lease will lapse", tag, exc)
            return
        if outcome is Outcome.FENCED:
            logger.warning(
                "celery_emq: release of %s fenced: another claim holds the job now; left to it",
                tag,
            )
        if outcome is Outcome.STARTED:
            self.hold(claim.store, claim.queue, [(claim.job_id, claim.token)], self.interval_ms)
            if unseen:
                with self._lock:
                    self._unseen[tag] = time.monotonic()

    def let_go_of_orphans(self, known: set[str], after_s: float) -> list[str]:
        """Release claims kept for a started task that nobody will ever settle.

        When the connection drops, a prefork child may have started a task the
        worker had not yet heard of; the claim is kept, for the task runs on.
        But Celery drops such a job from its pool's table (it was not accepted
        yet), so it never acks it: held, the claim would be renewed for ever.
        A kept claim that has not appeared among the worker's known tasks
        (``known``) within ``after_s`` goes back to its queue, uncounted (the
        job was not at fault); it runs again. Returns the delivery tags let go.
        """
        now = time.monotonic()
        orphans: list[str] = []
        with self._lock:
            for tag, since in list(self._unseen.items()):
                if tag not in self._held or tag in known or tag in self._owed:
                    del self._unseen[tag]
                elif now - since >= after_s:
                    del self._unseen[tag]
                    orphans.append(tag)
        for tag in orphans:
            logger.warning(
                "celery_emq: %s started in a pool process this worker lost track of "
                "(the connection dropped before the worker heard of it): released to run again",
                tag,
            )
            self.release(tag)
        return orphans

    def get(self, tag: str) -> Claim | None:
        """Return a held claim without forgetting it."""
        with self._lock:
            return self._held.get(tag)

    @property
    def interval_ms(self) -> int:
        """How often held leases are renewed (the shortest interval asked for)."""
        return self._interval_ms or 1000

    def holds(self, store: JobStore) -> bool:
        """Return whether any held claim belongs to ``store``."""
        with self._lock:
            return any(c.store is store for c in self._held.values())

    def held_count(self, prefix: str = "") -> int:
        """Return how many claims this process holds.

        Only those of stores whose key prefix starts with ``prefix``, when given.
        """
        with self._lock:
            return sum(1 for c in self._held.values() if c.store.prefix.startswith(prefix))

    def is_lost(self, tag: str) -> bool:
        """Return whether a held claim's lease was found lost."""
        with self._lock:
            return tag in self._lost

    def renew_once(self, now_ms: int | None = None) -> list[str]:
        """Renew every held lease now, node by node; return the delivery tags newly found lost.

        Each node's share runs on that node's lane (see
        :mod:`celery_emq.store.nodes`), all of them bounded by the renewal
        interval: a node that hangs delays only its own leases, and is named
        in a warning once they are at risk. Inside a share each queue (its
        owed acks first, then its renewals) is served on its own
        (:func:`~celery_emq.store.nodes.each_queue`): a queue whose slot
        migrates waits alone, its master's other queues are renewed.

        Raises:
            Exception: the first error of a node or queue, once every share
                was applied (the others' renewals stand).
        """
        self._pass_began = time.monotonic()
        with self._lock:
            claims = [(t, c) for t, c in self._held.items() if t not in self._lost]
            owed = set(self._owed)
        by_node: dict[str, dict[QueueOf, list[tuple[str, Claim]]]] = {}
        for tag, claim in claims:
            of_node = by_node.setdefault(claim.store.node_of(claim.queue), {})
            of_node.setdefault((id(claim.store), claim.queue), []).append((tag, claim))
        shares = {
            node: partial(self._renew_node, node, queues, owed, now_ms)
            for node, queues in by_node.items()
        }
        results = self._lanes.run(shares, self.interval_ms / 1000)
        self.renewals += 1
        #: Whether a node's share of this pass was still under way at its bound.
        self.pass_late = any(share.late for share in results.values())
        lost: list[str] = []
        errors: list[BaseException] = []
        for node, share in results.items():
            count = sum(len(held) for held in by_node[node].values())
            if share.late:
                self._report_late(node, count, share.busy_s)
                continue
            outcomes = share.value or {}
            if share.error is not None:
                outcomes = {q: Share(error=share.error) for q in by_node[node]}
            for (store_id, queue), outcome in outcomes.items():
                key = f"{queue} on {node}"
                if outcome.error is None:
                    lost.extend(outcome.value or [])
                    if failed := self._failures.pop(key, 0):
                        logger.warning(
                            "celery_emq: leases of %s renewed again, after %d failed attempt(s)",
                            key,
                            failed,
                        )
                    continue
                errors.append(outcome.error)
                failures = self._failures[key] = self._failures.get(key, 0) + 1
                (logger.warning if failures == 1 else logger.debug)(
                    "celery_emq: renewing %d lease(s) of %s failed (%d in a row): %r; "
                    "its other queues are renewed meanwhile",
                    len(by_node[node][(store_id, queue)]),
                    key,
                    failures,
                    outcome.error,
                )
        if errors:
            raise errors[0]
        return lost

    def _renew_node(
        self,
        node: str,
        queues: dict[QueueOf, list[tuple[str, Claim]]],
        owed: set[str],
        now_ms: int | None,
    ) -> dict[QueueOf, Share[list[str]]]:
        """One node's share of a pass: each queue's owed acks, then its renewals."""
        began = time.monotonic()
        # Queues that failed last pass go last: one whose slot migrates takes
        # its redirections' time (about 0.4 s) after the others are renewed.
        order = sorted(queues, key=lambda q: f"{q[1]} on {node}" in self._failures)
        outcomes = each_queue(order, lambda q: self._renew_queue(queues[q], owed, now_ms, began))
        if any(o.done for o in outcomes.values()):
            with self._lock:
                last, self._node_renewed_at[node] = self._node_renewed_at.get(node), began
            if last is not None:
                self._late.over(
                    node,
                    "celery_emq: leases on %s renewed again, %.1f s after the renewal before "
                    "(renewal interval %.1f s; reported late for %.1f s)",
                    node,
                    began - last,
                    self.interval_ms / 1000,
                )
        return outcomes

    def _renew_queue(
        self, claims: list[tuple[str, Claim]], owed: set[str], now_ms: int | None, began: float
    ) -> list[str]:
        """One queue's share: ack its owed claims, renew the rest; return the tags found lost."""
        owing = [c for t, c in claims if t in owed]
        if owing:
            self._settle_owed(owing)
        with self._lock:
            held = [
                (c.job_id, c.token) for t, c in claims if t in self._held and t not in self._owed
            ]
        if not held:
            return []
        store, queue = claims[0][1].store, claims[0][1].queue
        lost = [delivery_tag(*c) for c in store.extend(queue, held, now_ms=now_ms)]
        with self._lock:
            self._renewed_at[(id(store), queue)] = began
            # A claim settled while its renewal was on the way is not lost.
            found = [t for t in lost if t in self._held]
            self._lost.update(found)
        if found:
            logger.warning(
                "celery_emq: %d lease(s) were lost before renewal (the job was "
                "recovered elsewhere): %s",
                len(found),
                ", ".join(found[:10]),
            )
        return lost

    def _report_late(self, node: str, count: int, busy_s: float) -> None:
        """Warn, once, that ``node``'s renewals are so late that its leases are at risk.

        A pass that ends after the renewal interval is no risk yet (a lease
        outlives about three intervals): it is logged at debug level until the
        last renewal is two intervals old.
        """
        interval_s = self.interval_ms / 1000
        renewed_at = self._node_renewed_at.get(node)
        since_s = busy_s if renewed_at is None else time.monotonic() - renewed_at
        args = (count, node, max(0.0, since_s - interval_s), since_s, interval_s)
        msg = (
            "celery_emq: the renewal of %d lease(s) on %s is %.1f s late (last renewed %.1f s "
            "ago, renewal interval %.1f s): the node does not answer; other nodes' leases "
            "are renewed meanwhile"
        )
        if since_s < 2 * interval_s and node not in self._late:
            logger.debug(msg, *args)
            return
        self._late.report(node, msg, *args)

    def overdue_nodes(self, intervals: float = 1.0) -> set[str]:
        """Nodes holding claims of this process not renewed within ``intervals`` intervals."""
        return {node for node, _store, _queue in self._overdue(intervals)}

    def overdue_queues(self, intervals: float = 1.0) -> set[tuple[int, str]]:
        """Queues (``id(store)``, name) whose claims of this process are overdue for renewal."""
        return {(store, queue) for _node, store, queue in self._overdue(intervals)}

    def _overdue(self, intervals: float) -> set[tuple[str, int, str]]:
        limit_s = intervals * self.interval_ms / 1000
        now = time.monotonic()
        with self._lock:
            claims = [c for t, c in self._held.items() if t not in self._lost]
            renewed = dict(self._renewed_at)
        queues = {(c.store.node_of(c.queue), id(c.store), c.queue) for c in claims}
        return {q for q in queues if now - renewed.get(q[1:], float("-inf")) >= limit_s}

    def renew_if_overdue(self, now_ms: int | None = None) -> list[str]:
        """Renew the held leases unless every node's renewal succeeded within the interval.

        The sweep thread calls this before it sweeps. When every thread of the
        process was held up for longer than a lease (a C call that keeps the
        GIL, a greenlet that blocks the gevent or eventlet hub), the sweep may
        run again before this keeper does: renewing first means a process never
        counts a stall against a claim it holds itself. Returns the delivery
        tags newly found lost, as :meth:`renew_once` does.

        Nothing is renewed while the keeper's passes keep coming and every
        overdue queue failed in the last one (its slot migrating): another
        pass now would only hold up the keeper's next one on the same lanes.
        """
        overdue = self._overdue(1.0)
        if not self._held or not overdue:
            return []
        failing = {f"{queue} on {node}" for node, _store, queue in overdue} <= set(self._failures)
        if failing and time.monotonic() - self._pass_began < self.interval_ms / 1000:
            return []
        return self.renew_once(now_ms)

    def _run(self) -> None:
        failures = 0
        began = time.monotonic()
        while True:
            interval_ms = self.interval_ms
            # After a failure retry at once (the failed connection was dropped,
            # the next call opens a fresh one), then within a second: a lease
            # outlives about two renewal intervals, so one missed pass must not
            # wait a whole one.
            if failures:
                # 0.1, 0.2, 0.4, 0.8 s, then every second at most: a node's share
                # that was still waiting out its timeout makes the next pass skip
                # it, and its retry must come well before the lease lapses.
                wait_ms = min(100 * 2 ** min(failures - 1, 4), interval_ms, 1000)
            else:
                wait_ms = interval_ms
            # Counted from the start of the last pass: a pass that waited on a
            # node that hangs does not push back the next renewal of the others.
            elapsed_ms = (time.monotonic() - began) * 1000
            self._wake.wait(max(0.0, wait_ms - elapsed_ms) / 1000)
            self._wake.clear()
            began = time.monotonic()
            if not self._held:
                continue
            try:
                if self._unseen:
                    self.let_go_of_orphans(host().started_delivery_tags(), ORPHAN_AFTER_S)
                self.renew_once()
                # A queue whose renewal failed (recorded per queue, not raised),
                # or a node whose share outlasted the pass (a call waiting out
                # its timeout), is retried as soon as a failed pass would be.
                failures = failures + 1 if self._failures or self.pass_late else 0
            except Exception as exc:
                failures += 1
                # Each failing node was named in a warning (renew_once).
                logger.debug("celery_emq: lease renewal failed (%r); retrying", exc)
