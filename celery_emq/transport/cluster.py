"""The channel for a Redis Cluster (``emq+cluster://node:7000/0``).

Three clients, each for what it can do on a cluster:

- the store's :class:`~redis.cluster.RedisCluster` runs every script and keyed
  command on the node owning the queue's slot (each queue's keys share the
  hash tag ``{queue}``), following failovers and resharding;
- a plain client on one live node serves kombu's pub/sub (fanout: remote
  control, events): a cluster delivers a ``PUBLISH`` on any node to
  subscribers on every node. kombu's binding tables, which are keys, go
  through the cluster client;
- the claims' blocking wait: a waker thread per slot, on a RedisCluster of
  its own (see :mod:`~celery_emq.transport.wakers`).

A master that is down or hangs delays only its own queues: the consumer's scan
asks each master on a lane of its own.
"""

from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from functools import partial
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterError, RedisClusterException, TryAgainError

from celery_emq.store.nodes import NODE_ERRORS, Lanes, Troubles, each_queue
from celery_emq.store.outcomes import Scan
from celery_emq.store.retries import CLUSTER_RETRIES, bound_cluster, cluster_class, cluster_retry
from celery_emq.transport.wakers import WakingChannel

__all__ = ["ClusterChannel"]

logger = logging.getLogger(__name__)

#: Longest a consumer's scan waits for one master's answer; one that hangs
#: is skipped (its lane stays busy) while the others' queues are consumed.
SCAN_BOUND_S = 1.0

#: What a queue's own call raises while its slot migrates (``ClusterError``:
#: redis-py's redirections ran out, ``TRYAGAIN`` included): the queue waits
#: alone, the consumer goes on.
QUEUE_ERRORS = (TryAgainError, AskError, ClusterError)


class ClusterChannel(WakingChannel):
    """A channel whose store and claims run on a Redis Cluster."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._node: tuple[str, int] | None = None
        self._wake_client: RedisCluster | None = None
        self._wake_client_lock = threading.Lock()
        self._wake_closed = False
        self._scan_lanes: Lanes[str] = Lanes("celery_emq-scan")
        #: Masters that do not answer the consumer.
        self._unanswered = Troubles()
        #: Queues whose own calls fail (a slot migrating).
        self._failing = Troubles()
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
        """A node of the cluster that answers now: the first to answer a ping.

        Every node is pinged at once, each from a thread of its own, so nodes
        that hang cost the caller (kombu's event loop, when it connects) one
        socket timeout at most, not one each in turn. The nodes are asked in a
        random order, which spreads the workers' pub/sub over them.
        """
        if self._node is not None:
            return self._node
        cluster = self.store.client
        nodes = list(cluster.get_nodes())
        random.shuffle(nodes)
        last: BaseException | None = None
        pool = ThreadPoolExecutor(max(1, len(nodes)), thread_name_prefix="celery_emq-ping")
        try:
            pings = {pool.submit(cluster.get_redis_connection(n).ping): n for n in nodes}
            for ping in as_completed(pings, timeout=self.store_timeout_s + 1):
                if (last := ping.exception()) is None:
                    node = pings[ping]
                    self._node = (node.host, int(node.port))
                    return self._node
        except FuturesTimeout as exc:
            last = last or exc
        finally:
            # A ping to a node that hangs ends on its socket timeout, unwaited.
            pool.shutdown(wait=False)
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

    # -- one master down delays only its own queues ----------------------------

    def _scan(self, queues: list[str]) -> Scan:
        """Scan ``queues`` (see :meth:`JobStore.scan`): each master asked on its own lane.

        A master that fails or does not answer within :data:`SCAN_BOUND_S`
        has its queues left out of this scan, and a queue whose own call
        failed (its slot migrating: ``TRYAGAIN``, ``ASK``, ``ClusterError``)
        is left out alone; the others are claimed. Only when every master
        fails as a node (:data:`NODE_ERRORS`) does the error reach Celery
        (which reconnects).
        """
        by_node: dict[str, list[str]] = {}
        for q in queues:
            by_node.setdefault(self.store.node_of(q), []).append(q)
        shares = {node: partial(self.store.scan, qs) for node, qs in by_node.items()}
        found: list[str] = []
        due: list[int] = []
        errors: list[BaseException] = []
        for node, share in self._scan_lanes.run(shares, SCAN_BOUND_S).items():
            if share.done and share.value is not None:
                found.extend(share.value.waiting)
                if share.value.next_due_ms is not None:
                    due.append(share.value.next_due_ms)
                self._answered(node, by_node[node])
                for q in by_node[node]:
                    if q in share.value.failed:
                        self._queue_fails(node, q, share.value.failed[q])
                    else:
                        self._queue_answers(q)
            elif share.error is not None and not isinstance(share.error, NODE_ERRORS):
                # Every queue of the master failed on its own (one queue, migrating).
                self._answered(node, by_node[node])
                for q in by_node[node]:
                    self._queue_fails(node, q, share.error)
            else:
                if share.error is not None:
                    errors.append(share.error)
                why = share.error or f"no answer within {max(share.busy_s, SCAN_BOUND_S):.1f} s"
                self._unanswering(node, by_node[node], why)
        if errors and len(errors) == len(shares):
            raise errors[0]
        return Scan(found, min(due) if due else None)

    def _claim_and_deliver(self, queue: str, held: int) -> bool:
        # A claim follows a wake marker its master just popped, or a scan it
        # just answered: only a master that stops answering in between costs
        # the event loop a call's worst case.
        node = self.store.node_of(queue)
        outcome = each_queue([queue], partial(super()._claim_and_deliver, held=held))[queue]
        if outcome.error is None:
            return bool(outcome.value)
        # Nothing of the batch is held (a claim whose reply was lost lapses,
        # uncounted: its task never started).
        if isinstance(outcome.error, NODE_ERRORS):
            self._unanswering(node, [queue], outcome.error)
        elif isinstance(outcome.error, QUEUE_ERRORS):
            self._queue_fails(node, queue, outcome.error)
        else:
            raise outcome.error
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

    def _queue_fails(self, node: str, queue: str, why: BaseException) -> None:
        self._failing.report(
            queue,
            "celery_emq: queue %s on %s fails on its own (%r; its slot may be migrating): "
            "it waits; the master's other queues are consumed meanwhile",
            queue,
            node,
            why,
        )

    def _queue_answers(self, queue: str) -> None:
        self._failing.over(queue, "celery_emq: queue %s is consumed again (after %.1f s)", queue)

    def close(self) -> None:
        # The wakers end first (see WakingChannel.close); only then is their
        # client closed (closed earlier, a reply on its way would be lost, or
        # a retry reopen it).
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
    """A RedisCluster retrying as :class:`~celery_emq.store.retries.BoundedRedisCluster` says.

    No seed node answering is a connection error (kombu retries it).
    """
    try:
        cluster = cluster_class(retries)(retry=cluster_retry(retries), **kwargs)
        return bound_cluster(cluster, CLUSTER_RETRIES + retries)
    except RedisClusterException as exc:
        raise redis.ConnectionError(str(exc)) from exc
