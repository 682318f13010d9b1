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
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from celery_emq.store.nodes import Lanes, Troubles
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
        # Claims handed out as suspects whose task has not been heard to start,
        # each with the monotonic time it stops counting as one (see
        # awaits_suspect).
        self._suspects: dict[str, float] = {}
        # What to call once each of them is cleared (see hold_suspect).
        self._on_clear: dict[str, Callable[[], None]] = {}
        self._interval_ms: int | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        #: When each node's last renewal that succeeded began (monotonic
        #: seconds), by node (``JobStore.node_of``).
        self._node_renewed_at: dict[str, float] = {}
        #: Failed renewals in a row, per node.
        self._node_failures: dict[str, int] = {}
        self._lanes: Lanes[str] = Lanes("celery_emq-renew")
        self._late = Troubles()
        self.renewals = 0

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
            on_clear = self._clear_suspect(tag)
            held = self._held.pop(tag, None)
        self._tell_cleared(on_clear)
        return held

    def hold_suspect(
        self, tag: str, for_s: float, on_clear: Callable[[], None] | None = None
    ) -> None:
        """Note a held claim handed out as a suspect: this process takes no other for now.

        A suspect lapsed before its task ever started: it may be a message that
        kills the process receiving it. Should this process die before it
        starts, the sweep blames it alone and forgives every other claim of
        its queue, so this process holds one at a time (:meth:`awaits_suspect`):
        until its task is heard to start (:meth:`started`), it is settled or
        released, its lease is found lost, or ``for_s`` seconds passed (a
        message that kills its receiver does so at once; one that waits, say
        for its ETA or a rate limit, must not hold back the next for long).
        ``on_clear`` is called (outside the keeper's lock, in the thread that
        heard of it) once it starts, is settled or released.
        """
        with self._lock:
            if tag in self._held:
                self._suspects[tag] = time.monotonic() + for_s
                if on_clear is not None:
                    self._on_clear[tag] = on_clear

    def _clear_suspect(self, tag: str) -> Callable[[], None] | None:
        """Drop a suspect; return what to call now that it is cleared. Under the lock."""
        self._suspects.pop(tag, None)
        return self._on_clear.pop(tag, None)

    @staticmethod
    def _tell_cleared(on_clear: Callable[[], None] | None) -> None:
        if on_clear is not None:
            try:
                on_clear()
            except Exception:
                logger.debug("celery_emq: a suspect's clearing was not told", exc_info=True)

    def started(self, tag: str) -> None:
        """Note that a held claim's task started: it is no longer a suspect of this process."""
        with self._lock:
            on_clear = self._clear_suspect(tag)
        self._tell_cleared(on_clear)

    def awaits_suspect(self) -> bool:
        """Whether a suspect this process holds has not started yet: take no other now."""
        now = time.monotonic()
        with self._lock:
            for tag, until in list(self._suspects.items()):
                if tag not in self._held or tag in self._lost or now >= until:
                    self._clear_suspect(tag)
            return bool(self._suspects)

    def suspect_hold_s(self) -> float:
        """How long, at most, the suspect this process holds counts as one (0: none)."""
        if not self.awaits_suspect():
            return 0.0
        with self._lock:
            until = min(self._suspects.values(), default=time.monotonic())
        return max(0.0, until - time.monotonic())

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

    def _settle_owed(self, claims: list[tuple[str, Claim]]) -> int:
        """Ack ``claims`` whose ack failed before; return how many went through."""
        groups: dict[tuple[int, str], list[Claim]] = {}
        for _tag, c in claims:
            groups.setdefault((id(c.store), c.queue), []).append(c)
        settled = 0
        for group in groups.values():
            group[0].store.ack_many(group[0].queue, [(c.job_id, c.token) for c in group])
            with self._lock:
                for c in group:
                    tag = delivery_tag(c.job_id, c.token)
                    self._owed.discard(tag)
                    self._held.pop(tag, None)
            settled += len(group)
        if settled:
            logger.info("celery_emq: %d deferred ack(s) went through", settled)
        return settled

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

        Each node's share (its owed acks first, then its renewals) runs on
        that node's lane (see :mod:`celery_emq.store.nodes`), all of them bounded by
        the renewal interval: a node that hangs delays only its own leases,
        and is named in a warning saying how late their renewal is.

        Raises:
            Exception: the first node's error, once every node's share was
                applied (the others' renewals stand).
        """
        with self._lock:
            claims = [(t, c) for t, c in self._held.items() if t not in self._lost]
            owed = set(self._owed)
        by_node: dict[str, list[tuple[str, Claim]]] = {}
        for tag, claim in claims:
            by_node.setdefault(claim.store.node_of(claim.queue), []).append((tag, claim))
        shares = {
            node: partial(self._renew_node, node, held, owed, now_ms)
            for node, held in by_node.items()
        }
        results = self._lanes.run(shares, self.interval_ms / 1000)
        self.renewals += 1
        lost: list[str] = []
        errors: list[BaseException] = []
        for node, share in results.items():
            if share.done:
                lost.extend(share.value or [])
                self._node_failures.pop(node, None)
            elif share.error is not None:
                errors.append(share.error)
                failures = self._node_failures[node] = self._node_failures.get(node, 0) + 1
                log = logger.warning if failures == 1 else logger.debug
                log(
                    "celery_emq: renewing %d lease(s) on %s failed (%d in a row): %r",
                    len(by_node[node]),
                    node,
                    failures,
                    share.error,
                )
            else:
                self._report_late(node, len(by_node[node]), share.busy_s)
        if errors:
            raise errors[0]
        return lost

    def _renew_node(
        self,
        node: str,
        claims: list[tuple[str, Claim]],
        owed: set[str],
        now_ms: int | None,
    ) -> list[str]:
        """One node's share of a pass: ack its owed claims, then renew its leases."""
        began = time.monotonic()
        owing = [(t, c) for t, c in claims if t in owed]
        if owing:
            self._settle_owed(owing)
        groups: dict[tuple[int, str], tuple[JobStore, list[tuple[str, str]]]] = {}
        with self._lock:
            for tag, claim in claims:
                if tag in self._held and tag not in self._owed:
                    entry = groups.setdefault((id(claim.store), claim.queue), (claim.store, []))
                    entry[1].append((claim.job_id, claim.token))
        lost: list[str] = []
        for (_, queue), (store, held) in groups.items():
            lost.extend(delivery_tag(*c) for c in store.extend(queue, held, now_ms=now_ms))
        self._late.over(node, "celery_emq: leases on %s renewed again (late for %.1f s)", node)
        with self._lock:
            self._node_renewed_at[node] = began
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
        """Warn that ``node``'s renewals did not end within the renewal interval."""
        interval_s = self.interval_ms / 1000
        renewed_at = self._node_renewed_at.get(node)
        since_s = busy_s if renewed_at is None else time.monotonic() - renewed_at
        self._late.report(
            node,
            "celery_emq: the renewal of %d lease(s) on %s is %.1f s late (last renewed %.1f s "
            "ago, renewal interval %.1f s): the node does not answer; other nodes' leases "
            "are renewed meanwhile",
            count,
            node,
            max(0.0, since_s - interval_s),
            since_s,
            interval_s,
        )

    def overdue_nodes(self, intervals: float = 1.0) -> set[str]:
        """Nodes holding claims of this process not renewed within ``intervals`` intervals."""
        limit_s = intervals * self.interval_ms / 1000
        now = time.monotonic()
        with self._lock:
            claims = [c for t, c in self._held.items() if t not in self._lost]
            renewed = dict(self._node_renewed_at)
        nodes = {c.store.node_of(c.queue) for c in claims}
        return {n for n in nodes if now - renewed.get(n, float("-inf")) >= limit_s}

    def renew_if_overdue(self, now_ms: int | None = None) -> list[str]:
        """Renew the held leases unless every node's renewal succeeded within the interval.

        The sweep thread calls this before it sweeps. When every thread of the
        process was held up for longer than a lease (a C call that keeps the
        GIL, a greenlet that blocks the gevent or eventlet hub), the sweep may
        run again before this keeper does: renewing first means a process never
        counts a stall against a claim it holds itself. Returns the delivery
        tags newly found lost, as :meth:`renew_once` does.
        """
        if not self._held or not self.overdue_nodes():
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
            if failures == 1:
                wait_ms = 100
            elif failures:
                wait_ms = min(interval_ms, 1000)
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
                failures = 0
            except Exception as exc:
                failures += 1
                # Each failing node was named in a warning (renew_once).
                logger.debug("celery_emq: lease renewal failed (%r); retrying", exc)
