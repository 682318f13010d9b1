"""The claims' blocking wait on a Redis Cluster: a waker thread per slot.

One ``BRPOP`` over several queues' wake lists is refused on a cluster
(``CROSSSLOT``), so a :class:`Waker` per slot blocks on the wake lists of that
slot's queues and signals the event loop through a socket pair
(:class:`WakeConnection`), which kombu's poller watches in place of the BRPOP
connection (see docs/concepts.md, "On a Redis Cluster").
:class:`WakingChannel` is the channel's side of it: it arms the wakers when
the loop waits, and claims from each queue whose marker one popped.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections import deque
from functools import cached_property
from time import monotonic
from typing import Any

from kombu.utils.encoding import bytes_to_str
from redis.cluster import RedisCluster
from redis.crc import key_slot

from celery_emq.transport.channel import Channel

__all__ = ["RETRY_S", "WakeClient", "WakeConnection", "Waker", "WakingChannel"]

logger = logging.getLogger(__name__)

#: How long a waker backs off after a failed wait before it waits again.
RETRY_S = 0.5


class WakeConnection:
    """A socket pair standing in for the BRPOP connection in kombu's poller.

    kombu's poller watches ``channel.client.connection._sock``; the wakers
    write a byte to the other end when a marker was popped (or a scan is due).
    """

    def __init__(self, channel: WakingChannel) -> None:
        self._channel = channel
        self._sock: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._lock = threading.Lock()

    def connect(self) -> None:
        with self._lock:
            if self._sock is None:
                self._sock, self._writer = socket.socketpair()
                self._writer.setblocking(False)

    def signal(self) -> None:
        """Make the poller see the channel readable (from any thread)."""
        with self._lock:
            if self._writer is not None:
                try:
                    self._writer.send(b"x")
                except BlockingIOError:
                    pass  # already readable: the loop will read every popped marker

    def drain(self) -> None:
        """Read every signal byte, so the socket is quiet until the next signal."""
        sock = self._sock
        if sock is None:
            return
        while select.select([sock], [], [], 0)[0]:
            try:
                if not sock.recv(4096):
                    return
            except OSError:
                return

    def can_read(self, timeout: float = 0) -> bool:
        sock = self._sock
        return bool(sock is not None and select.select([sock], [], [], timeout)[0])

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            sock, writer, self._sock, self._writer = self._sock, self._writer, None, None
        for s in (sock, writer):
            if s is not None:
                s.close()
        if sock is not None and self._channel._registered:
            self._channel._on_connection_disconnect(self)


class WakeClient:
    """What kombu's poller and Channel use of ``channel.client`` on a cluster."""

    def __init__(self, channel: WakingChannel) -> None:
        self._channel = channel
        self.connection: WakeConnection | None = None
        self.connection_pool = self

    def get_connection(self, *args: Any, **kwargs: Any) -> WakeConnection:
        return WakeConnection(self._channel)

    def ping(self) -> Any:
        # As kombu's channel does on creation: through its pool on the live
        # node, which also sets the fanout prefix (from the database number).
        return self._channel._create_client(asynchronous=True).ping()


class Waker(threading.Thread):
    """Blocks on the wake lists of one slot's queues; reports each popped marker."""

    def __init__(self, channel: WakingChannel, queues: dict[str, str], timeout_s: float) -> None:
        super().__init__(name=f"emq-waker-{next(iter(queues.values()))}", daemon=True)
        #: wake (and soon) key -> queue
        self.queues = queues
        #: A list of this waker's slot only it waits on: a push ends its wait (see stop).
        self.nudge_key = channel.store.keys(next(iter(queues.values()))).base + (
            f"nudge:{channel._nudge_id}"
        )
        self._channel = channel
        self._timeout_s = timeout_s
        self.armed = threading.Event()
        self.stopped = False
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Have the thread end after its current wait (or at once if it waits to be armed)."""
        self.stopped = True
        self._stopping.set()
        self.armed.set()

    def run(self) -> None:
        try:
            self._wait()
        finally:
            if not self.stopped:
                # Ended by an error no wait survives: wake the loop, whose
                # next wait starts a waker in this one's place.
                self._channel._signal()

    def _wait(self) -> None:
        keys = [*self.queues, self.nudge_key]
        failures = 0
        while not self.stopped:
            if not self.armed.wait(self._timeout_s):
                continue
            if self.stopped:
                break
            try:
                client = self._channel._wake_redis()
                reply = client.brpop(keys, timeout=round(self._channel._wait_timeout_s(), 3))
                if reply is None:
                    self._timed_out()
                elif bytes_to_str(reply[0]) == self.nudge_key:
                    continue  # stopped (or a nudge meant for an earlier wait)
                elif bytes_to_str(reply[0]) in self._channel._soon_keys:
                    self._report_soon(bytes_to_str(reply[0]))
                else:
                    self._report(self.queues[bytes_to_str(reply[0])])
            except Exception as exc:
                # A failover or a reconnect: the loop scans (and meets the
                # error itself, so Celery reconnects); wait again shortly.
                failures += 1
                log = logger.warning if failures == 1 else logger.debug
                log("celery_emq: waiting on %s failed (%d in a row): %r", keys, failures, exc)
                self._channel._tick()
                self._stopping.wait(RETRY_S)
                continue
            if failures:
                logger.info("celery_emq: waiting on %s again after %d failures", keys, failures)
                failures = 0

    def _timed_out(self) -> None:
        """The wait ended with its timeout: the loop's scan is due (armed again after it).

        Unless the loop scanned meanwhile (another slot's waker timed out
        first): then this one waits again, until the next scan is due.
        """
        if monotonic() < self._channel._next_scan_at:
            return
        with self._channel._wake_lock:
            if self.armed.is_set() and not self.stopped:
                self.armed.clear()
                self._channel._signal()

    def _report_soon(self, key: str) -> None:
        """Have the loop scan now: a delayed job is due before any its wait knew of."""
        with self._channel._wake_lock:
            keep = self.armed.is_set() and not self.stopped
            if keep:
                # Armed again after the scan, which learns the new due time.
                self.armed.clear()
                self._channel._next_scan_at = 0.0
                self._channel._signal()
        if not keep:
            # Another consumer waiting may act on it.
            self._channel.store.signal_soon(self.queues[key])

    def _report(self, queue: str) -> None:
        """Hand the loop the marker popped from ``queue``'s wake list."""
        with self._channel._wake_lock:
            keep = self.armed.is_set() and not self.stopped
            if keep:
                # One marker popped: wait to be armed again once the loop claimed.
                self.armed.clear()
                self._channel._woke(queue)
        if not keep:
            # Disarmed during the wait: the channel's prefetch is full, or it
            # no longer waits on this queue. Another consumer may take the job.
            self._channel._give_back_marker(queue)


class WakingChannel(Channel):
    """A channel whose claims wait on wakers, one per slot of its queues."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wakers: dict[int, Waker] = {}
        self._popped: deque[str] = deque()
        self._ticked_at = monotonic()
        #: Serialises a waker's report of a pop with the loop's disarming.
        self._wake_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _wake_redis(self) -> RedisCluster:
        """The client the wakers block on (the cluster channel's)."""
        raise NotImplementedError

    @cached_property
    def client(self) -> Any:
        """Not a Redis client: the wakers' signal, watched by kombu's poller."""
        return WakeClient(self)

    # -- claims: a waker per slot --------------------------------------------

    @property
    def _wait_s(self) -> float:
        return self._idle_wait_s

    def _wake_groups(self) -> dict[int, dict[str, str]]:
        """The wake and soon lists of the active queues, by slot (key -> queue)."""
        groups: dict[int, dict[str, str]] = {}
        for q in self.active_queues:
            keys = self.store.keys(q)
            group = groups.setdefault(key_slot(keys.wake.encode()), {})
            group[keys.wake] = q
            group[keys.soon] = q
            self._soon_keys.add(keys.soon)
        return groups

    def _retire_wakers(self, groups: dict[int, dict[str, str]]) -> bool:
        """Stop each waker whose slot's queues are no longer ``groups``'s, or that ended.

        Returns:
            Whether any waker was stopped.
        """
        retired = False
        with self._wake_lock:
            for slot, waker in list(self._wakers.items()):
                if groups.get(slot) == waker.queues and waker.is_alive():
                    continue
                if not waker.is_alive() and not waker.stopped:
                    logger.warning("celery_emq: %s had ended; starting another", waker.name)
                waker.stop()
                del self._wakers[slot]
                retired = True
        return retired

    def _brpop_start(self, timeout: float | None = None) -> None:
        groups = self._wake_groups()
        self._retire_wakers(groups)
        if not groups:
            return
        for slot, keys in groups.items():
            if slot not in self._wakers:
                self._wakers[slot] = Waker(self, keys, self._wait_s)
                self._wakers[slot].start()
            self._wakers[slot].armed.set()
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        if self._popped and self._in_poll is not None:
            # Popped while the signal's socket was down: signal again.
            self._in_poll.signal()

    def _basic_cancel(self, consumer_tag: str) -> Any:
        result = super()._basic_cancel(consumer_tag)
        if self._retire_wakers(self._wake_groups()) and self._in_poll:
            # The other queues of a retired waker's slot need a waker of
            # their own: the poller's next wait starts it.
            self._in_poll = None
        return result

    def _end_waits(self, wakers: list[Waker]) -> None:
        """End the stopped wakers' waits now (an idle wait lasts seconds)."""
        try:
            client = self._wake_redis()
            for waker in wakers:
                if waker.is_alive():
                    pipe = client.pipeline(transaction=False)
                    pipe.lpush(waker.nudge_key, 1).pexpire(waker.nudge_key, 60_000)
                    pipe.execute()
        except Exception:
            # Each waker still ends within its wait.
            logger.debug("celery_emq: could not end the wakers' waits early", exc_info=True)

    def _nudge(self) -> None:
        """Wake the loop: it scans the queue just consumed; its next wait arms its waker."""
        self._next_scan_at = 0.0
        self._signal()

    def _woke(self, queue: str) -> None:
        """A waker popped ``queue``'s marker (called from its thread)."""
        self._popped.append(queue)
        self._signal()

    def _signal(self) -> None:
        """Make kombu's poller see the channel readable (from any thread)."""
        connection = self.client.connection
        if connection is not None:
            connection.signal()

    def _tick(self) -> None:
        """A wait timed out: wake the loop for a scan, at most once a scan interval."""
        now = monotonic()
        if now - self._ticked_at >= self._scan_interval_s:
            self._ticked_at = now
            self._signal()

    def _take_popped(self) -> list[str]:
        connection = self.client.connection
        if connection is not None:
            connection.drain()
        popped = []
        while self._popped:
            popped.append(self._popped.popleft())
        return popped

    def _brpop_read(self, **options: Any) -> bool:
        self._in_poll = None
        try:
            return self._deliver_woken(self._take_popped())
        finally:
            if not self.qos.can_consume():
                # As a single server gets no BRPOP while the prefetch is full,
                # no waker waits until the next _brpop_start arms them again.
                with self._wake_lock:
                    for waker in self._wakers.values():
                        waker.armed.clear()

    def _poll_error(self, type: str, **options: Any) -> None:
        if type == "BRPOP":
            if self.client.connection is not None:
                self.client.connection.disconnect()
            return
        super()._poll_error(type, **options)

    def close(self) -> None:
        # Each waker ends within its wait: one that pops meanwhile gives the
        # marker back itself. Only then are the markers the loop did not
        # read given back (and, after this, the wakers' client closed).
        with self._wake_lock:
            wakers = list(self._wakers.values())
            self._wakers.clear()
            for waker in wakers:
                waker.stop()
        self._end_waits(wakers)
        deadline = monotonic() + self._wait_s + 1
        for waker in wakers:
            waker.join(max(0.0, deadline - monotonic()))
            if waker.is_alive():
                logger.warning("celery_emq: %s did not end within its wait", waker.name)
        self._in_poll = None
        for queue in self._take_popped():
            try:
                self._give_back_marker(queue)
            except Exception:
                # The scan of other consumers finds the job within an interval.
                logger.debug("celery_emq: could not give back a marker of %s", queue)
        super().close()
