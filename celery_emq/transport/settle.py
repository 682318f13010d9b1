"""Settles sent together: one round trip carries a process's acks and start records.

Inside a Celery worker an ack need not reach Redis the moment Celery sends it:
the lease still covers the job. The process-wide :class:`SettleBatcher` queues
acks, and the start records a worker writes for its prefork children, for up to
``settle_delay_ms`` and sends what it holds together: one ``ack`` script call per
queue and one ``start`` call per record, in one pipeline per store (one round
trip). It sends at once when it holds :data:`SETTLE_BATCH` settles, when a
channel closes, when the process exits, when a task is about to run in the
process that holds its claim (that start record must reach Redis before the
task's body runs, and it carries the queued acks with it), and before the
process takes a suspect (see ``Consuming._claim``): none of them may die with it.

The start records go first in each pipeline, and a start goes even when its
task's ack goes with it (a prefork task done within the delay): the server runs
a pipeline in order, so the start is written before the ack.

Outside a running worker (a plain kombu consumer, the CLI, a test) nothing
waits: each settle is sent when it is made, as before.

Every queued settle names its claim (job id and token), exactly as a single
one does: a settle sent late is fenced like one sent early. An ack that cannot
be sent goes to the lease keeper's owed acks (:meth:`LeaseKeeper.owe_acks`):
the claim is held and renewed until an ack gets through.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import redis

from celery_emq.store.nodes import Lanes
from celery_emq.store.scripts import Outcome
from celery_emq.transport.lease import Claim, delivery_tag, keeper

if TYPE_CHECKING:
    from celery_emq.store.jobstore import JobStore
    from celery_emq.store.scripts import Batch

__all__ = ["SETTLE_BATCH", "SettleBatcher", "batcher"]

logger = logging.getLogger(__name__)

#: Settles queued at which the batcher sends at once, whatever the delay.
SETTLE_BATCH = 128

#: How long a send waits for a server's answer before it goes on without it (the
#: send ends on its own, within its socket timeout).
SEND_BOUND_S = 1.0

_ACK_OUTCOMES = {
    Outcome.LEASE_LOST: "the lease had lapsed; the job completed, so it was deleted from pending",
    Outcome.DEAD: "the lease had lapsed; the job completed, so it left the morgue",
    Outcome.FENCED: "fenced: another claim holds the job now; left to it, marked completed",
    Outcome.NOT_FOUND: "already gone",
}


class SettleBatcher:
    """Queues a process's acks and start records and sends them in one round trip."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due_changed = threading.Condition(self._lock)
        # One send at a time, so what was queued first reaches Redis first.
        self._send_lock = threading.Lock()
        self._acks: dict[str, Claim] = {}
        self._starts: dict[str, Claim] = {}
        #: Suspects their consumer received whole (see :meth:`receive`).
        self._receipts: dict[str, Claim] = {}
        #: When the queued settles must be sent (monotonic seconds), if any are.
        self._due: float | None = None
        #: Settles taken by a send that has not returned yet.
        self._sending = 0
        #: Start records whose threads wait in start_now; the error of a send
        #: that took one of them and raised, for that thread to raise.
        self._starting: set[str] = set()
        self._start_errors: dict[str, BaseException] = {}
        self._thread: threading.Thread | None = None
        self._lanes: Lanes[str] = Lanes("celery_emq-settle")
        #: The delay a worker's channels asked for (``settle_delay_ms``).
        self.delay_ms = 0
        #: Whether settles wait for company: set once the worker is ready.
        self.deferring = False
        #: Round trips sent (one per store per send), for tests and curiosity.
        self.sends = 0

    @property
    def effective_delay_ms(self) -> int:
        """How long a settle waits for company now (0: sent when made)."""
        return self.delay_ms if self.deferring else 0

    def queued(self) -> int:
        """Return how many settles wait to be sent, or are being sent."""
        with self._lock:
            return len(self._acks) + len(self._starts) + len(self._receipts) + self._sending

    def ack(self, claims: Sequence[Claim]) -> None:
        """Ack finished claims (already forgotten by the keeper), now or within the delay."""
        if claims:
            self._queue("ack", claims)

    def ack_tags(self, tags: Sequence[str]) -> None:
        """Ack the held claims named by delivery ``tags``: forgotten and queued in one step."""
        if tags:
            self._queue("ack", (), forget=tags)

    def start(self, claim: Claim) -> None:
        """Record that a claim's task started, now or within the delay."""
        self._queue("start", [claim])

    def receive(self, claim: Claim) -> None:
        """Record that a suspect's consumer received it whole, now or within the delay.

        It goes with the next send at the latest, and so before the body of
        any task that records its start in this process (:meth:`start_now`):
        a task that kills its process after it starts is not taken for a
        suspect's early kill (see ``Consuming._received``).
        """
        self._queue("receive", [claim])

    def start_now(self, claim: Claim) -> None:
        """Record a start before the task's body runs, with every queued settle.

        Under solo, threads, gevent or eventlet the task runs in the process
        that holds its claim, and a task that kills its process kills the
        batcher too: the record must be in Redis before the body starts.

        Starts made by other threads while a send is under way wait for it and
        go together in the next one: each thread returns once the send that
        carried its record has returned, so a pool of N threads pays about one
        round trip for up to N starts, not one each in turn.
        """
        tag = delivery_tag(claim.job_id, claim.token)
        with self._lock:
            self._starts[tag] = claim
            self._starting.add(tag)
        try:
            with self._send_lock:
                with self._lock:
                    queued = tag in self._starts
                    failed = None if queued else self._start_errors.pop(tag, None)
                if queued:
                    self._flush_sending()
                elif failed is not None:
                    # The send that took this record raised in another thread.
                    raise RuntimeError(f"the send carrying this start failed: {failed!r}")
                with self._lock:
                    received = bool(self._receipts)
                if received:
                    # A suspect was received while this start was on its way:
                    # its record goes before this body runs, or a body that
                    # kills this process would leave the suspect the blame.
                    self._flush_sending()
        except BaseException:
            with self._lock:
                # Interrupted before any send took it: no record for a body
                # that may not run.
                self._starts.pop(tag, None)
            raise
        finally:
            with self._lock:
                self._starting.discard(tag)
                self._start_errors.pop(tag, None)

    def _queue(self, kind: str, claims: Sequence[Claim], forget: Sequence[str] = ()) -> None:
        delay_ms = self.effective_delay_ms
        with self._lock:
            if forget:
                # Under this lock: no claim is seen neither held nor queued.
                claims = [c for c in map(keeper().forget, forget) if c is not None]
                if not claims:
                    return
            # Looked up under the lock: a send takes the queues away and leaves new ones.
            into = {"ack": self._acks, "start": self._starts}.get(kind, self._receipts)
            for c in claims:
                into[delivery_tag(c.job_id, c.token)] = c
            full = len(self._acks) + len(self._starts) + len(self._receipts) >= SETTLE_BATCH
            if delay_ms > 0 and not full:
                due = time.monotonic() + delay_ms / 1000
                if self._due is None or due < self._due:
                    self._due = due
                    self._due_changed.notify()
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="celery_emq-settle", daemon=True
                    )
                    self._thread.start()
                return
        self.flush()

    def flush(self) -> None:
        """Send every queued settle now, one round trip per store."""
        with self._send_lock:
            self._flush_sending()

    def _flush_sending(self) -> None:
        """Send every queued settle; the caller holds the send lock."""
        with self._lock:
            acks, self._acks = self._acks, {}
            starts, self._starts = self._starts, {}
            receipts, self._receipts = self._receipts, {}
            self._due = None
            # Still waiting, as far as queued() is concerned, until sent or owed.
            self._sending = len(acks) + len(starts) + len(receipts)
        try:
            # A start goes even when its task's ack goes with it: see _send.
            if acks or starts or receipts:
                self._send(list(acks.values()), list(starts.values()), list(receipts.values()))
        except BaseException as exc:
            with self._lock:
                # Each thread waiting in start_now for one of these raises too.
                for tag in starts.keys() & self._starting:
                    self._start_errors[tag] = exc
            raise
        finally:
            with self._lock:
                self._sending = 0

    def _send(self, acks: list[Claim], starts: list[Claim], receipts: Sequence[Claim] = ()) -> None:
        """Send the settles of each server (each Cluster master) on its own lane, bounded.

        A server that hangs delays only its own settles: the others' go
        through. One whose lane is still busy with an earlier send gets none:
        its acks are owed to the lease keeper (which acks them with its
        renewals of that server) and its start records are not made. When
        this returns, every ack was sent or is owed.
        """
        by_node: dict[tuple[int, str], _StoreSend] = {}
        # Start records first: each server runs its pipeline in order, so a
        # start is written before the ack of its task sent with it. A server
        # that then loses its last writes (a restart from a snapshot, a
        # failover to a replica that lagged) and with them the ack keeps the
        # start unless it lost both: the job comes back a started claim, and
        # its lapse is a stall, not a lapse before a start.
        for c in receipts:
            # Suspects received whole: no answer is waited for (one that fails
            # leaves the suspect one, and the sweep may blame it).
            key = (id(c.store), c.store.node_of(c.queue))
            entry = by_node.setdefault(key, _StoreSend(c.store))
            entry.batch.start(c.store.keys(c.queue), c.job_id, c.token, received=True)
            entry.receipts.append(c)
        for c in starts:
            key = (id(c.store), c.store.node_of(c.queue))
            entry = by_node.setdefault(key, _StoreSend(c.store))
            entry.starts.append((c, entry.batch.start(c.store.keys(c.queue), c.job_id, c.token)))
        by_queue: dict[tuple[int, str], list[Claim]] = {}
        for c in acks:
            by_queue.setdefault((id(c.store), c.queue), []).append(c)
        for (store_id, queue), claims in by_queue.items():
            store = claims[0].store
            entry = by_node.setdefault((store_id, store.node_of(queue)), _StoreSend(store))
            pairs = [(c.job_id, c.token) for c in claims]
            entry.acks.append((queue, claims, entry.batch.ack(entry.store.keys(queue), pairs)))
        # A lane per store and server (a Cluster's master).
        entries = {f"{node}#{store_id}": e for (store_id, node), e in by_node.items()}
        shares = {key: partial(self._send_one, e) for key, e in entries.items()}
        bound_s = max(_bound_s(e.store) for e in entries.values())
        for lane, share in self._lanes.run(shares, bound_s).items():
            if share.skipped:
                busy = f"{lane} is still busy with settles sent {share.busy_s:.1f} s ago"
                self._undelivered(entries[lane], redis.TimeoutError(busy))
            elif share.late:
                # Still under way: its acks are owed now, so that none waits on
                # this send alone (an ack that lands twice finds nothing the
                # second time); its start records land when the send does.
                late = redis.TimeoutError(f"{lane} did not answer within {bound_s:.1f} s")
                for queue, claims, _ in entries[lane].acks:
                    _owe(queue, claims, late)
            elif share.error is not None:
                logger.error("celery_emq: sending settles to %s failed: %r", lane, share.error)

    def _undelivered(self, entry: _StoreSend, exc: Exception) -> None:
        # Whatever failed (a RedisError, or a cluster client's own exception),
        # these acks are owed, never dropped.
        for queue, claims, _ in entry.acks:
            _owe(queue, claims, exc)
        for claim, _ in entry.starts:
            _start_failed(claim, exc)

    def _send_one(self, entry: _StoreSend) -> None:
        """Send one server's settles in one round trip; owe the acks that failed."""
        self.sends += 1
        store = entry.store
        confirm = None
        if store.wait_replicas:
            # One WAIT on the connection that carried this store's settles.
            queue = (
                entry.acks[0][0]
                if entry.acks
                else (entry.starts[0][0] if entry.starts else entry.receipts[0]).queue
            )
            confirm = partial(store.confirm_replicas, queue=queue)
        try:
            entry.batch.execute(confirm=confirm)
        except Exception as exc:
            self._undelivered(entry, exc)
            return
        for queue, claims, handle in entry.acks:
            try:
                outcomes = entry.batch.result(handle)
            except redis.RedisError as exc:
                _owe(queue, claims, exc)
                continue
            except Exception:
                logger.exception("celery_emq: ack of %d job(s) in %s failed", len(claims), queue)
                continue
            _log_ack_outcomes(queue, claims, outcomes)
        if confirm is not None and (entry.batch.confirmed or 0) < store.wait_replicas:
            logger.warning(
                "celery_emq: %d settle(s) confirmed by %d of %d replica(s) within %d ms "
                "(wait_replicas): after a failover their tasks may run again; nothing is lost",
                len(entry.starts) + sum(len(claims) for _, claims, _ in entry.acks),
                entry.batch.confirmed or 0,
                store.wait_replicas,
                store.wait_timeout_ms,
            )
        for claim, handle in entry.starts:
            try:
                outcome = entry.batch.result(handle)
            except Exception as exc:
                _start_failed(claim, exc)
                continue
            if outcome is Outcome.FENCED:
                logger.warning(
                    "celery_emq: start of %s in %s (claim %s) fenced: another claim "
                    "holds the job now",
                    claim.job_id,
                    claim.queue,
                    claim.token,
                )
            elif outcome is not Outcome.OK:
                logger.debug(
                    "celery_emq: start of %s in %s (claim %s) not recorded: %s",
                    claim.job_id,
                    claim.queue,
                    claim.token,
                    outcome.name,
                )

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._due is None:
                    self._due_changed.wait()
                wait_s = self._due - time.monotonic()
                if wait_s > 0:
                    self._due_changed.wait(wait_s)
                    continue
            try:
                self.flush()
            except Exception:
                logger.exception("celery_emq: sending queued settles failed")


def _bound_s(store: JobStore) -> float:
    """How long a send to one server is waited for: a second, or a ``WAIT``'s time and more."""
    if store.wait_replicas:
        return max(SEND_BOUND_S, store.wait_timeout_ms / 1000 + 0.5)
    return SEND_BOUND_S


class _StoreSend:
    """What one send carries to one store."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.batch: Batch = store.scripts.batch()
        self.acks: list[tuple[str, list[Claim], int]] = []
        self.starts: list[tuple[Claim, int]] = []
        self.receipts: list[Claim] = []


def _owe(queue: str, claims: list[Claim], exc: Exception) -> None:
    # The tasks finished: their claims stay held and renewed, and the keeper
    # acks them once Redis answers again.
    keeper().owe_acks(claims)
    logger.warning(
        "celery_emq: ack of %d job(s) in %s failed (%r); retried by the lease keeper",
        len(claims),
        queue,
        exc,
    )


def _start_failed(claim: Claim, exc: Any) -> None:
    logger.warning(
        "celery_emq: could not record the start of job %s in %s (%r); if its worker "
        "dies now, the job is requeued without counting a stall",
        claim.job_id,
        claim.queue,
        exc,
    )


def _log_ack_outcomes(queue: str, claims: list[Claim], outcomes: list[Outcome]) -> None:
    for claim, outcome in zip(claims, outcomes, strict=True):
        if outcome is not Outcome.OK:
            logger.warning(
                "celery_emq: ack of %s in %s (claim %s): %s",
                claim.job_id,
                queue,
                claim.token,
                _ACK_OUTCOMES.get(outcome, outcome.name),
            )


_batcher: SettleBatcher | None = None
_batcher_lock = threading.Lock()


_exit_hook = False


def batcher() -> SettleBatcher:
    """Return the process-wide settle batcher (what it holds is sent at exit)."""
    global _batcher, _exit_hook
    with _batcher_lock:
        if _batcher is None:
            _batcher = SettleBatcher()
            if not _exit_hook:
                atexit.register(_flush_at_exit)
                _exit_hook = True
        return _batcher


def _flush_at_exit() -> None:
    if _batcher is not None:
        try:
            _batcher.flush()
        except Exception:
            logger.exception("celery_emq: sending queued settles at exit failed")


def _after_fork_in_child() -> None:
    # What the parent queued is the parent's to send; the child starts empty
    # (and, until its own worker is ready, sends each settle when made).
    global _batcher, _batcher_lock
    _batcher = None
    _batcher_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
