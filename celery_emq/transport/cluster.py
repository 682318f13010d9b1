"""The channel for a Redis Cluster (``emq+cluster://node:7000/0``).

Three clients, each for what it can do on a cluster:

- the store's :class:`~redis.cluster.RedisCluster` runs every script and keyed
  command on the node owning the queue's slot (each queue's keys share the
  hash tag ``{queue}``), following failovers and resharding;
- a plain client on one live node serves kombu's pub/sub (fanout: remote
  control, events): a cluster delivers a ``PUBLISH`` on any node to
  subscribers on every node. kombu's binding tables, which are keys, go
  through the cluster client;
- the claims' blocking wait: one ``BRPOP`` over several queues' wake lists is
  refused (``CROSSSLOT``), so a waker thread per slot blocks on the wake lists
  of that slot's queues and signals the event loop through a socket pair, which
  kombu's poller watches in place of the BRPOP connection (see
  docs/concepts.md, "On a Redis Cluster").
"""

from __future__ import annotations

import logging
import random
import select
import socket
import threading
from collections import deque
from functools import cached_property, partial
from time import monotonic
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import ClusterDownError, RedisClusterException

from celery_emq.store.nodes import Lanes, Troubles
from celery_emq.store.retries import CLUSTER_RETRIES, bound_cluster, cluster_class, cluster_retry
from celery_emq.transport.channel import Channel

__all__ = ["ClusterChannel"]

logger = logging.getLogger(__name__)

#: How long a waker backs off after a failed wait before it waits again.
RETRY_S = 0.5

#: Longest a consumer's scan waits for one master's answer; one that hangs
#: is skipped (its lane stays busy) while the others' queues are consumed.
SCAN_BOUND_S = 1.0

#: What one master that is down, hung or failing over raises: its queues wait,
#: the others' are consumed (no consumer restart that would wait on it).
NODE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException)


class WakeConnection:
    """A socket pair standing in for the BRPOP connection in kombu's poller.

    kombu's poller watches ``channel.client.connection._sock``; the wakers
    write a byte to the other end when a marker was popped (or a scan is due).
    """

    def __init__(self, channel: ClusterChannel) -> None:
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


class _WakeClient:
    """What kombu's poller and Channel use of ``channel.client`` on a cluster."""

    def __init__(self, channel: ClusterChannel) -> None:
        self._channel = channel
        self.connection: WakeConnection | None = None
        self.connection_pool = self

    def get_connection(self, *args: Any, **kwargs: Any) -> WakeConnection:
        return WakeConnection(self._channel)

    def ping(self) -> Any:
        # As kombu's channel does on creation: through its pool on the live
        # node, which also sets the fanout prefix (from the database number).
        return self._channel._create_client(asynchronous=True).ping()


class _Waker(threading.Thread):
    """Blocks on the wake lists of one slot's queues; reports each popped marker."""

    def __init__(self, channel: ClusterChannel, queues: dict[str, str], timeout_s: int) -> None:
        super().__init__(name=f"emq-waker-{next(iter(queues.values()))}", daemon=True)
        #: wake key -> queue
        self.queues = queues
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
        keys = list(self.queues)
        failures = 0
        while not self.stopped:
            if not self.armed.wait(self._timeout_s):
                continue
            if self.stopped:
                break
            try:
                client = self._channel._wake_redis()
                reply = client.brpop(keys, timeout=self._timeout_s)
                if reply is None:
                    self._channel._tick()
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


class ClusterChannel(Channel):
    """A channel whose store and claims run on a Redis Cluster."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wakers: dict[int, _Waker] = {}
        self._popped: deque[str] = deque()
        self._ticked_at = monotonic()
        self._node: tuple[str, int] | None = None
        self._wake_client: RedisCluster | None = None
        self._wake_client_lock = threading.Lock()
        self._wake_closed = False
        #: Serialises a waker's report of a pop with the loop's disarming.
        self._wake_lock = threading.Lock()
        self._scan_lanes: Lanes[str] = Lanes("celery_emq-scan")
        #: Masters that do not answer the consumer.
        self._unanswered = Troubles()
        super().__init__(*args, **kwargs)

    # -- clients ---------------------------------------------------------

    def _cluster_kwargs(self) -> dict[str, Any]:
        target = self.connection.target
        conninfo = self.connection.client
        kwargs: dict[str, Any] = {
            "startup_nodes": [ClusterNode(host, port) for host, port in target.nodes],
            "username": target.username,
            "password": target.password,
            "socket_connect_timeout": self.socket_connect_timeout,
            "socket_keepalive": self.socket_keepalive,
            "socket_keepalive_options": self.socket_keepalive_options,
        }
        if self.client_name is not None:
            kwargs["client_name"] = self.client_name
        if target.tls or conninfo.ssl:
            kwargs["ssl"] = True
            if isinstance(conninfo.ssl, dict):
                kwargs.update(conninfo.ssl)
        return kwargs

    def _new_store_client(self) -> Any:
        """A RedisCluster over the URL's seed nodes, for the store."""
        return _cluster(
            self.emq.command_retries, socket_timeout=self.store_timeout_s, **self._cluster_kwargs()
        )

    def _wake_redis(self) -> RedisCluster:
        """The wakers' RedisCluster, for their blocking waits (a socket timeout past the wait).

        Built by the first waker to wait (it connects: it may fail, and the
        waker tries again), once for all of them.
        """
        with self._wake_client_lock:
            if self._wake_closed:
                raise redis.ConnectionError("the channel is closed")
            if self._wake_client is None:
                self._wake_client = _cluster(
                    self.emq.command_retries,
                    socket_timeout=self._wait_s + 10,
                    **self._cluster_kwargs(),
                )
            return self._wake_client

    @cached_property
    def client(self) -> Any:
        """Not a Redis client: the wakers' signal, watched by kombu's poller."""
        return _WakeClient(self)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's parameters, pointed at one live node (for pub/sub and publishing)."""
        params = super()._connparams(asynchronous)
        target = self.connection.target
        host, port = self._live_node()
        params.pop("path", None)
        params.update(host=host, port=port, db=0)
        params["username"] = target.username
        params["password"] = target.password
        if params.get("connection_class") is redis.UnixDomainSocketConnection:
            params["connection_class"] = self.connection_class
        if not asynchronous:
            # Broadcasts (events, remote control) are published from the event
            # loop: a node that hangs must not hold it for the channel's
            # socket timeout (see _put_fanout).
            params["socket_timeout"] = self.store_timeout_s
        return params

    def _put_fanout(self, exchange: str, message: Any, routing_key: str, **kwargs: Any) -> Any:
        """Publish a broadcast on the live node; if it does not answer, once more on another.

        A cluster forwards a ``PUBLISH`` on any node to the subscribers on
        every node, so any node that answers will do.
        """
        batched = kwargs.get("_publish_batch") is not None
        try:
            return super()._put_fanout(exchange, message, routing_key, **kwargs)
        except NODE_ERRORS as exc:
            if batched or self._node is None:
                raise
            logger.warning(
                "celery_emq: %s:%s does not answer a broadcast (%r): publishing on another node",
                *self._node,
                exc,
            )
            pool, self._pool, self._node = self._pool, None, None
            if pool is not None:
                pool.disconnect()
            return super()._put_fanout(exchange, message, routing_key, **kwargs)

    def _live_node(self) -> tuple[str, int]:
        """A node of the cluster that answers now, picked at random (spreads pub/sub)."""
        if self._node is not None:
            return self._node
        cluster = self.store.client
        nodes = list(cluster.get_nodes())
        random.shuffle(nodes)
        last: Exception | None = None
        for node in nodes:
            try:
                cluster.get_redis_connection(node).ping()
            except redis.RedisError as exc:
                last = exc
                continue
            self._node = (node.host, int(node.port))
            return self._node
        raise redis.ConnectionError(f"no node of the cluster answers: {last!r}")

    # -- kombu's binding tables: keys, on the cluster client ----------------

    def _binding_key(self, exchange: str) -> str:
        return self.global_keyprefix + self.keyprefix_queue % (exchange,)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        # kombu 5.7 also keeps binding deadlines for x-expires queues, in a
        # script over keys of several slots: here the table is a plain set.
        if self.typeof(exchange).type == "fanout":
            self._fanout_queues[queue] = (exchange, routing_key.replace("#", "*"))
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        self.store.client.sadd(self._binding_key(exchange), member)
        if queue in self._queue_ttl:
            # Nothing deletes a reply queue's binding when its consumer vanishes:
            # the expiry pass removes it once the queue is gone.
            self.store.note_binding(queue, self._binding_key(exchange), member)

    def get_table(self, exchange: str) -> list[tuple[str, ...]]:
        values = self.store.client.smembers(self._binding_key(exchange))
        return [tuple(bytes_to_str(v).split(self.sep)) for v in values]

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.auto_delete_queues.discard(queue)
        if len(args) >= 3:
            exchange, routing_key, pattern = args[:3]
            member = self.sep.join([routing_key or "", pattern or "", queue or ""])
            self.store.client.srem(self._binding_key(exchange), member)
        self.store.purge(queue)

    def maybe_refresh_binding_expiry(self) -> None:
        """Nothing to refresh: tables on a cluster carry no deadline."""

    def sweep_bindings(self, limit: int = 100) -> int:
        return 0

    # -- claims: a waker per slot --------------------------------------------

    @property
    def _wait_s(self) -> int:
        return max(1, int(self.brpop_timeout or 1))

    def _wake_groups(self) -> dict[int, dict[str, str]]:
        """The wake lists of the active queues, by slot (wake key -> queue)."""
        groups: dict[int, dict[str, str]] = {}
        for q in self.active_queues:
            key = self.store.keys(q).wake
            groups.setdefault(key_slot(key.encode()), {})[key] = q
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
                self._wakers[slot] = _Waker(self, keys, self._wait_s)
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

    # -- one master down delays only its own queues ----------------------------

    def _waiting(self, queues: list[str]) -> list[str]:
        """Those of ``queues`` that have jobs to claim: each master asked on its own lane.

        A master that fails or does not answer within :data:`SCAN_BOUND_S`
        has its queues left out of this scan; the others' are claimed. Only
        when every master fails does the error reach Celery (which reconnects).
        """
        by_node: dict[str, list[str]] = {}
        for q in queues:
            by_node.setdefault(self.store.node_of(q), []).append(q)
        shares = {node: partial(self.store.waiting, qs) for node, qs in by_node.items()}
        found: list[str] = []
        errors: list[BaseException] = []
        for node, share in self._scan_lanes.run(shares, SCAN_BOUND_S).items():
            if share.done:
                found.extend(share.value or [])
                self._answered(node, by_node[node])
            else:
                if share.error is not None:
                    errors.append(share.error)
                why = share.error or f"no answer within {max(share.busy_s, SCAN_BOUND_S):.1f} s"
                self._unanswering(node, by_node[node], why)
        if errors and len(errors) == len(shares):
            raise errors[0]
        return found

    def _claim_and_deliver(self, queue: str, held: int) -> bool:
        try:
            return super()._claim_and_deliver(queue, held)
        except NODE_ERRORS as exc:
            # Nothing of the batch is held (a claim whose reply was lost
            # lapses, uncounted: its task never started).
            self._unanswering(self.store.node_of(queue), [queue], exc)
            return False

    def _unanswering(self, node: str, queues: list[str], why: object) -> None:
        self._unanswered.report(
            node,
            "celery_emq: %s does not answer (%s): its queues %s wait for it; "
            "the other masters' queues are consumed meanwhile",
            node,
            why if isinstance(why, str) else repr(why),
            ", ".join(queues),
        )

    def _answered(self, node: str, queues: list[str]) -> None:
        self._unanswered.over(
            node,
            "celery_emq: %s answers again: its queues %s are consumed (after %.1f s)",
            node,
            ", ".join(queues),
        )

    def _poll_error(self, type: str, **options: Any) -> None:
        if type == "BRPOP":
            if self.client.connection is not None:
                self.client.connection.disconnect()
            return
        super()._poll_error(type, **options)

    def close(self) -> None:
        # Each waker ends within its wait: one that pops meanwhile gives the
        # marker back itself. Only then are the markers the loop did not
        # read given back, and the wakers' client closed (closed earlier, a
        # reply on its way would be lost, or a retry reopen it).
        with self._wake_lock:
            wakers = list(self._wakers.values())
            self._wakers.clear()
            for waker in wakers:
                waker.stop()
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
        # A scan's call to a master that hangs ends within its socket timeout.
        self._scan_lanes.close(self.store_timeout_s + 1)
        with self._wake_client_lock:
            self._wake_closed = True
            client, self._wake_client = self._wake_client, None
        if client is not None:
            client.close()

    def _disconnect_store(self) -> None:
        self.store.client.close()


def _cluster(retries: int, **kwargs: Any) -> RedisCluster:
    """A RedisCluster retrying as :class:`~celery_emq.retries.BoundedRedisCluster` says.

    No seed node answering is a connection error (kombu retries it).
    """
    try:
        cluster = cluster_class(retries)(retry=cluster_retry(retries), **kwargs)
        return bound_cluster(cluster, CLUSTER_RETRIES + retries)
    except RedisClusterException as exc:
        raise redis.ConnectionError(str(exc)) from exc
