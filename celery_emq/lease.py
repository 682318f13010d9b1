"""Lease renewal: one thread per process renews every lease the process holds.

The keeper is process-wide, not per channel, so a lease outlives the channel
that claimed it: after a broker reconnect the new channel claims under the same
:func:`worker_identity`, and deliveries of the old channel that are still
running keep their leases and can still be acked.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import JobStore

__all__ = ["LeaseKeeper", "keeper", "worker_identity"]

logger = logging.getLogger(__name__)

_identity: str | None = None
_keeper: LeaseKeeper | None = None
_lock = threading.Lock()


def worker_identity() -> str:
    """Return this process's stable lease owner (host, pid and a random part)."""
    global _identity
    if _identity is None:
        _identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    return _identity


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
    global _identity, _keeper, _lock
    _identity = None
    _keeper = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LeaseKeeper:
    """Holds the leases of one process and renews them from a daemon thread.

    Args:
        owner: the identity every claim of this process is made under.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._held: dict[str, tuple[JobStore, str]] = {}
        self._lost: set[str] = set()
        self._interval_ms: int | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0

    def hold(self, store: JobStore, queue: str, job_ids: list[str], interval_ms: int) -> None:
        """Start renewing ``job_ids`` of ``queue`` every ``interval_ms`` at most."""
        with self._lock:
            for job_id in job_ids:
                self._held[job_id] = (store, queue)
            if self._interval_ms is None or interval_ms < self._interval_ms:
                self._interval_ms = interval_ms
                self._wake.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery_emq-lease-keeper", daemon=True
                )
                self._thread.start()

    def forget(self, job_id: str) -> tuple[JobStore, str] | None:
        """Stop renewing a job (acked, released or dead); return where it was held."""
        with self._lock:
            self._lost.discard(job_id)
            return self._held.pop(job_id, None)

    def holds(self, store: JobStore) -> bool:
        """Return whether any held job belongs to ``store``."""
        with self._lock:
            return any(s is store for s, _ in self._held.values())

    def held_count(self) -> int:
        """Return how many leases this process holds."""
        with self._lock:
            return len(self._held)

    def renew_once(self, now_ms: int | None = None) -> list[str]:
        """Renew every held lease now; return the ids newly found lost."""
        groups: dict[tuple[int, str], tuple[JobStore, list[str]]] = {}
        with self._lock:
            for job_id, (store, queue) in self._held.items():
                if job_id in self._lost:
                    continue
                entry = groups.get((id(store), queue))
                if entry is None:
                    entry = groups[(id(store), queue)] = (store, [])
                entry[1].append(job_id)
        lost: list[str] = []
        for (_, queue), (store, ids) in groups.items():
            lost.extend(store.extend(queue, self.owner, ids, now_ms=now_ms))
        self.renewals += 1
        if lost:
            with self._lock:
                self._lost.update(j for j in lost if j in self._held)
            logger.warning(
                "celery_emq: %d lease(s) were lost before renewal (the job was "
                "recovered elsewhere): %s",
                len(lost),
                ", ".join(lost[:10]),
            )
        return lost

    def _run(self) -> None:
        failed = False
        while True:
            interval_ms = self._interval_ms or 1000
            # After a failure retry within a second: a lease outlives about
            # two renewal intervals, so one missed pass must not wait a whole one.
            self._wake.wait(min(interval_ms, 1000) / 1000 if failed else interval_ms / 1000)
            self._wake.clear()
            if not self._held:
                continue
            try:
                self.renew_once()
                failed = False
            except Exception:
                failed = True
                logger.exception("celery_emq: lease renewal failed; retrying")
