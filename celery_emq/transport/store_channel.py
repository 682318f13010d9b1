"""The channel's hold on the job store: its connections, the queue registry, settles.

:class:`StoreChannel` is what the consuming and publishing halves of the
channel (:mod:`~celery_emq.transport.consuming`,
:mod:`~celery_emq.transport.publishing`) share: the store on a connection pool
of its own, the task-queue registry, declaring and managing queues, and
settling deliveries (ack, release, dead-letter, charge a stall), each named by
its claim.
"""

from __future__ import annotations

import logging
import socket
import uuid
from time import monotonic
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Unset
from celery_emq.store.retries import connection_retry
from celery_emq.store.server import check_server
from celery_emq.transport.compat import ChannelCompat
from celery_emq.transport.lease import keeper
from celery_emq.transport.messages import queue_ttl_ms
from celery_emq.transport.process import transport_started
from celery_emq.transport.qos import QoS
from celery_emq.transport.settle import batcher
from celery_emq.transport.sweeper import Sweeper

__all__ = ["KEEPALIVE_OPTIONS", "REGISTER_EVERY_S", "StoreChannel"]

logger = logging.getLogger(__name__)

#: How often a channel records again that a queue it publishes to or consumes is a
#: task queue (the registry may have dropped it while it was empty).
REGISTER_EVERY_S = 60.0
#: TCP keepalive on every connection: a peer that vanished without closing the
#: connection is noticed after about 10 + 3 x 5 s of silence, not hours.
KEEPALIVE_OPTIONS: dict[int, int] = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}


class StoreChannel(ChannelCompat, kombu_redis.Channel):
    """A kombu Redis channel whose task queues live in the leased job store."""

    QoS = QoS
    connection_class: Any
    _in_poll: Any = False
    _brpop_sent_at: Any = None

    # No connection waits for ever on a dead link (kombu's defaults are None):
    # each is overridden by the transport option of the same name.
    socket_connect_timeout: Any = 5.0
    socket_timeout: Any = 10.0
    socket_keepalive: Any = True
    socket_keepalive_options: Any = KEEPALIVE_OPTIONS

    def __init__(self, connection: Any, *args: Any, **kwargs: Any) -> None:
        topts = connection.client.transport_options
        # Validate before connecting, so a bad option fails fast and by name.
        self.emq = EmqOptions.from_transport_options(topts)
        # The target, not the scheme: after a switch to the next alternate of
        # an emqs+sentinel:// URL, kombu names the transport "emqs+sentinel".
        # kombu applies ssl only when it is a dict of options: ssl=True (Celery's
        # broker_use_ssl=True) would leave its connections in plaintext, while
        # the cluster's and Flower's clients take it for TLS.
        if connection.target.tls or connection.client.ssl:
            self.connection_class = self.connection_class_ssl
        self._no_ack: dict[str, bool] = {}
        self._accept: dict[str, Any] = {}
        self._queue_ttl: dict[str, int] = {}
        self._wake_queues: dict[str, str] = {}
        self._store: JobStore | None = None
        self._store_pool: Any = None
        self._sweeper: Sweeper | None = None
        self._registered_at: dict[str, float] = {}
        self._noted_expiring_at: dict[str, float] = {}
        self._budgets: dict[str, int | Unset | None] = {}
        self._scanned_at = monotonic()
        #: The soon keys the consumer's wait blocks on (as BRPOP may name them).
        self._soon_keys: set[str] = set()
        #: Delivery tags of suspects claimed and not yet delivered (see
        #: ``Consuming._received``).
        self._unreceived: set[str] = set()
        #: When (monotonic) the consumer looks at its queues next: its wait ends then.
        self._next_scan_at = 0.0
        self._nudge_id = uuid.uuid4().hex
        super().__init__(connection, *args, **kwargs)
        # Inside a Celery worker, before it binds its message handlers: see
        # what its handling of lost processes and refused messages decides.
        transport_started()

    # -- the store -------------------------------------------------------

    @property
    def store(self) -> JobStore:
        """The job store, on a connection pool of its own.

        The pool is the channel's own so that the store keeps working for
        deliveries still running after kombu reset its pools (reconnect).
        """
        if self._store is None:
            self._store = JobStore(
                self._new_store_client(),
                self.emq.key_prefix,
                self.emq.lease_ms,
                self.emq.wait_replicas,
                self.emq.wait_timeout_ms,
            )
        return self._store

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's connection parameters, with the retry policy of ``command_retries``."""
        params = super()._connparams(asynchronous)
        params.update(connection_retry(self.emq.command_retries))
        return params

    def _new_store_client(self) -> Any:
        """A redis-py client for the store, on a pool of the channel's own."""
        params = self._connparams()
        params["socket_timeout"] = self.store_timeout_s
        self._store_pool = redis.ConnectionPool(**params)
        return redis.Redis(connection_pool=self._store_pool)

    @property
    def store_timeout_s(self) -> float:
        """The store's socket timeout: one renewal interval, from 1 to 5 s.

        A renewal stuck on a dead connection must fail in time for the keeper
        to retry on a fresh one before the lease lapses. With ``wait_replicas``
        it is at least ``wait_timeout_ms`` + 0.5 s, so a ``WAIT`` can run out.
        """
        bound = max(1.0, min(5.0, self.emq.renew_interval_ms / 1000))
        timeout = min(float(self.socket_timeout), bound) if self.socket_timeout else bound
        if self.emq.wait_replicas:
            # A publish or settle may block in WAIT for wait_timeout_ms: its
            # reply must not be cut off (it would read as a failed write).
            timeout = max(timeout, self.emq.wait_timeout_ms / 1000 + 0.5)
        return timeout

    @property
    def sweeper(self) -> Sweeper:
        """The sweeper over this channel's store (its follow-up: the registered one)."""
        if self._sweeper is None:
            self._sweeper = Sweeper(self.store, self.emq)
        return self._sweeper

    def _register(self, queue: str) -> None:
        """Record a task queue in the registry, again at most every REGISTER_EVERY_S."""
        now = monotonic()
        if now - self._registered_at.get(queue, -REGISTER_EVERY_S) >= REGISTER_EVERY_S:
            self.store.register(queue)
            self._registered_at[queue] = now

    def _note_expiring(self, queue: str, ttl_ms: int) -> None:
        """Keep an ``x-expires`` queue in the expiry registry, again every half TTL.

        The expiry pass drops a queue only once it went unused for a whole TTL,
        so a channel that noted it less than half a TTL ago need not again.
        """
        now = monotonic()
        if now - self._noted_expiring_at.get(queue, float("-inf")) >= ttl_ms / 2000:
            self.store.note_expiring(queue)
            self._noted_expiring_at[queue] = now

    def _check_server(self) -> None:
        """Warn once per process and server of settings that can lose jobs."""
        conninfo = self.connection.client
        where = (conninfo.hostname, conninfo.port, conninfo.virtual_host)
        if where in _checked_servers:
            return
        _checked_servers.add(where)
        try:
            check = check_server(self.store.client)
        except Exception as exc:
            logger.info("celery_emq: could not read the Redis server's settings: %r", exc)
            return
        for text in check.warnings:
            logger.warning("celery_emq: %s", text)
        for text in check.notes:
            logger.info("celery_emq: %s", text)

    @property
    def owner(self) -> str:
        return keeper().owner

    # -- declaring -------------------------------------------------------

    def _new_queue(self, queue: str, auto_delete: bool = False, **kwargs: Any) -> None:
        super()._new_queue(queue, auto_delete=auto_delete, **kwargs)
        ttl_ms = queue_ttl_ms(kwargs)
        if ttl_ms:
            self._queue_ttl[queue] = ttl_ms
            self.store.declare_expiring(queue, ttl_ms)
        else:
            self._queue_ttl.pop(queue, None)

    def _give_back_marker(self, queue: str) -> None:
        """Return a popped wake marker, so another consumer wakes for that job."""
        self.store.give_back(queue)

    # -- settling --------------------------------------------------------
    #
    # Every settle names its claim (job id and token): a settle whose claim is
    # no longer the job's live claim never changes the live claim of another.

    def _settle(self, tag: str) -> None:
        self._settle_many([tag])

    def _settle_many(self, tags: list[str]) -> None:
        """Ack deliveries: at once, or inside a worker with other settles (see settle.py)."""
        batcher().ack_tags(tags)

    def _release(self, tag: str, unless_started: bool = False) -> None:
        keeper().release(tag, unless_started)

    def _release_all(
        self, tags: list[str], unless_started: bool = False, unseen: bool = False
    ) -> None:
        for tag in tags:
            keeper().release(tag, unless_started, unseen)

    def _bury(self, tag: str, reason: str, error: str) -> None:
        claim = keeper().forget(tag)
        if claim is None:
            return
        Sweeper(claim.store, self.emq).bury(claim.queue, claim.job_id, claim.token, reason, error)

    def _charge(self, tag: str, reason: str) -> None:
        claim = keeper().forget(tag)
        if claim is None:
            return
        Sweeper(claim.store, self.emq).charge(
            claim.queue, claim.job_id, claim.token, reason, self.emq.max_stalled
        )

    def _restore(self, message: Any, leftmost: bool = False) -> None:
        self._release(message.delivery_tag)

    # -- queue management ------------------------------------------------

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.exists(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        super()._delete(queue, *args, **kwargs)
        self.store.purge(queue)

    def _disconnect_store(self) -> None:
        """Close the store's connections (none of its claims is held any longer)."""
        self._store_pool.disconnect()


#: Servers this process has checked (host, port, db): one warning each.
_checked_servers: set[tuple[Any, Any, Any]] = set()
