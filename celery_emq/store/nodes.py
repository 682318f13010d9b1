"""Per-node lanes: each Redis node's share of a pass runs on a thread of its own, bounded.

A pass that touches several nodes (a Cluster's masters: the keeper's renewals,
the sweeps, a consumer's scan) hands each node's share to that node's lane and
waits for all of them together, at most ``timeout_s``. A node that hangs then
holds up only its own share: the pass goes on with the others' results, and
the hung node's lane stays busy, so later passes skip it (nothing piles up
behind a call that has not returned) until its call returns or fails on its
socket timeout. A lane is one daemon thread, started when its node first has
work and stopped when a pass no longer names it; :meth:`Lanes.close` stops every
lane and joins each within a bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, Generic, TypeVar

from redis.exceptions import ClusterDownError, ConnectionError, RedisClusterException, TimeoutError

__all__ = ["NODE_ERRORS", "Lanes", "Share", "Troubles", "each_queue"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
Q = TypeVar("Q", bound=Hashable)

#: What says a node itself failed, not one of its queues: it is down or hangs
#: (a connection error, a timeout), or no master serves the slot
#: (``CLUSTERDOWN``, no node answers). Any other error is the queue's own: its
#: slot migrating (``TRYAGAIN``, ``ASK``, redis-py's ``ClusterError`` once its
#: redirections ran out), or a reply of its script.
NODE_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, RedisClusterException)


@dataclass(frozen=True)
class Share(Generic[T]):
    """What became of one node's share of a pass.

    Exactly one holds: ``done`` (``value`` is its result), ``error`` (it
    raised), or neither: ``late``, it did not end within the pass's bound (or
    the node's lane was still busy with an earlier share, since ``busy_s``:
    ``skipped``, this share never ran).
    """

    done: bool = False
    value: T | None = None
    error: BaseException | None = None
    #: How long the node's lane had been on its current share when the pass ended.
    busy_s: float = 0.0
    #: Late because the lane was still busy with an earlier share: this one never ran.
    skipped: bool = False

    @property
    def late(self) -> bool:
        return not self.done and self.error is None


class _Lane:
    """One node's thread: runs the shares handed to it, one at a time."""

    def __init__(self, name: str) -> None:
        self._work: SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = SimpleQueue()
        self.current: Future[Any] | None = None
        self.since = 0.0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self.current is not None and not self.current.done()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self.current, self.since = future, time.monotonic()
        self._work.put((fn, future))
        return future

    def stop(self) -> None:
        self._work.put(None)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


class Lanes(Generic[K]):
    """A lane per node, for one kind of pass (renewals, sweeps, a consumer's scans).

    Args:
        name: names the lanes' threads (``<name>-<node>``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lanes: dict[K, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def run(self, shares: Mapping[K, Callable[[], T]], timeout_s: float) -> dict[K, Share[T]]:
        """Run each node's share on its lane; wait for them all, at most ``timeout_s``.

        A node whose lane is still busy with an earlier share is not given
        this one: it is reported late at once. Lanes of nodes ``shares`` does
        not name, and idle, are stopped.
        """
        futures: dict[K, Future[T]] = {}
        out: dict[K, Share[T]] = {}
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: lanes closed")
            for node, fn in shares.items():
                lane = self._lanes.get(node)
                if lane is None:
                    lane = self._lanes[node] = _Lane(f"{self.name}-{node}")
                if lane.busy:
                    out[node] = Share(busy_s=time.monotonic() - lane.since, skipped=True)
                else:
                    futures[node] = lane.submit(fn)
            for node in [n for n, lane in self._lanes.items() if n not in shares]:
                if not self._lanes[node].busy:
                    self._lanes.pop(node).stop()
        if futures:
            wait(futures.values(), timeout=timeout_s)
        for node, future in futures.items():
            if not future.done():
                out[node] = Share(busy_s=time.monotonic() - self._lanes[node].since)
            elif (exc := future.exception()) is not None:
                out[node] = Share(error=exc)
            else:
                out[node] = Share(done=True, value=future.result())
        return out

    def close(self, timeout_s: float) -> None:
        """Stop every lane; join each, all within ``timeout_s``."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        deadline = time.monotonic() + timeout_s
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive():
                name = lane.thread.name
                logger.warning("celery_emq: %s did not end within %.1f s", name, timeout_s)


class Troubles:
    """Per node, whether it is in trouble: warned at once, again at most every ``every_s``.

    A node that hangs is reported on every pass; its log says so once, then
    now and then with the figures of the moment, and once more when it is
    over (:meth:`over`).
    """

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._since: dict[str, float] = {}
        self._warned: dict[str, float] = {}
        self._lock = threading.Lock()

    def report(self, node: str, msg: str, *args: object) -> None:
        """Log ``msg`` about ``node``: a warning unless one was logged within ``every_s``."""
        now = time.monotonic()
        with self._lock:
            self._since.setdefault(node, now)
            warn = now - self._warned.get(node, float("-inf")) >= self.every_s
            if warn:
                self._warned[node] = now
        (logger.warning if warn else logger.debug)(msg, *args)

    def over(self, node: str, msg: str, *args: object) -> None:
        """End ``node``'s trouble; log ``msg`` (with its length in s appended) if it had one."""
        with self._lock:
            since = self._since.pop(node, None)
            self._warned.pop(node, None)
        if since is not None:
            logger.warning(msg, *args, time.monotonic() - since)

    def __contains__(self, node: object) -> bool:
        return node in self._since


def each_queue(queues: Iterable[Q], fn: Callable[[Q], T]) -> dict[Q, Share[T]]:
    """Run ``fn`` on each of one node's queues; return each queue's outcome.

    The one way every per-node pass (renewals, owed acks, scans, sweeps,
    claims) goes through a node's queues. A queue whose call raises fails
    alone: its slot may be migrating, and the node's other queues are
    served as usual. An error of the node itself (:data:`NODE_ERRORS`) ends
    the share: each queue not yet tried gets that error without a call (each
    call would wait out its own socket timeout on a node that hangs).
    """
    out: dict[Q, Share[T]] = {}
    down: BaseException | None = None
    for queue in queues:
        if down is not None:
            out[queue] = Share(error=down)
            continue
        try:
            out[queue] = Share(done=True, value=fn(queue))
        except Exception as exc:
            out[queue] = Share(error=exc)
            if isinstance(exc, NODE_ERRORS):
                down = exc
    return out
