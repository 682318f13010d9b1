"""``emq+sentinel://``: the transport on the master that Redis Sentinel names.

The broker URL lists the sentinels
(``emq+sentinel://s1:26379;emq+sentinel://s2:26379/0``, read by
:func:`~celery_emq.store.topology.target_of`); the transport option ``master_name``
names the master they monitor. kombu's ``sentinel://`` options keep their
meaning: ``min_other_sentinels`` (a sentinel that knows fewer peers is not
believed) and ``sentinel_kwargs`` (how to connect to the sentinels themselves,
for instance their password, merged over the transport's own socket options).
The sentinels are asked as :mod:`celery_emq.store.discovery` says: each once, the
newest ``config-epoch`` wins, a hung one costs its timeout once.

Every connection the transport opens is one of redis-py's
``SentinelManagedConnection``: it asks the sentinels for the master's address
whenever it connects, and a connection that meets a demoted master (``READONLY``)
drops. kombu's clients (publish, the blocking claim's BRPOP, fanout pub/sub) and
the job store's client (lease keeper, settles, sweep, CLI) all reconnect to the
promoted replica after a failover.

A connection that never breaks would never ask again: after a failover the old
master may go on taking writes until the sentinels demote it (it came back
before they did, or a second failover left two masters for a while), and
whatever a client writes there is lost when it resyncs. So a thread of each
pool in use asks the sentinels again every :data:`MASTER_CHECK_S` and drops the
pool's idle connections when the answer changed (redis-py drops the busy ones as
they come back); the consumer's blocking claim, which holds its connection for
good, is dropped as a connection error when it is on a server no longer named,
and Celery reconnects. The asking is done off the threads that use the pool:
sentinels that do not answer (or answer slowly) never hold up a publish, a lease
renewal or the event loop.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from time import monotonic
from typing import Any

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

from celery_emq.errors import InvalidOptionError
from celery_emq.store.discovery import BoundedSentinel, sentinel_kwargs
from celery_emq.store.topology import BrokerTarget
from celery_emq.transport.channel import Channel
from celery_emq.transport.compat import sentinel_connection_classes

__all__ = ["MASTER_CHECK_S", "SentinelChannel"]

#: How often a pool in use asks the sentinels again which server is the master.
MASTER_CHECK_S = 1.0
#: A pool not used for this long is not asked about (its next use resumes the asking).
WATCH_IDLE_S = 30.0

#: The sentinel transport options, as kombu's ``sentinel://`` transport names them.
SENTINEL_OPTIONS = ("master_name", "min_other_sentinels", "sentinel_kwargs")


class MasterFollowingPool(SentinelConnectionPool):
    """A pool to the master whose watcher asks the sentinels again every :data:`MASTER_CHECK_S`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call,unused-ignore]
        self.used_at = monotonic()
        #: The process whose watcher thread watches this pool (none after a fork).
        self.watched_in: int | None = None

    def watch(self) -> tuple[str, int] | None:
        """Note a use, start this process's watcher if none runs; return the master known.

        Two threads racing here may start two watchers: harmless, both ask.
        """
        self.used_at = monotonic()
        if self.watched_in != os.getpid():
            self.watched_in = os.getpid()
            threading.Thread(
                target=_watch_master, args=(weakref.ref(self),), name="emq-sentinel", daemon=True
            ).start()
        address: tuple[str, int] | None = self.master_address
        return address

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.watch()
        return super().get_connection(*args, **kwargs)


def _watch_master(ref: weakref.ref[MasterFollowingPool]) -> None:
    """Ask the sentinels for a pool's master every MASTER_CHECK_S while the pool lives.

    A changed answer drops the pool's idle connections (redis-py's
    ``get_master_address``). Sentinels that do not answer leave the pool as it
    is: its connections ask them again when they connect.
    """
    while True:
        time.sleep(MASTER_CHECK_S)
        pool = ref()
        if pool is None or pool.watched_in != os.getpid():
            return
        if monotonic() - pool.used_at < WATCH_IDLE_S:
            try:
                pool.get_master_address()  # type: ignore[no-untyped-call,unused-ignore]
            except redis.RedisError:
                pass
        del pool


class SentinelChannel(Channel):
    """A channel whose every connection goes to the master the sentinels name."""

    from_transport_options = Channel.from_transport_options + SENTINEL_OPTIONS

    connection_class: Any
    connection_class_ssl: Any
    connection_class, connection_class_ssl = sentinel_connection_classes()

    master_name: Any = None
    min_other_sentinels: Any = 0
    sentinel_kwargs: Any = None

    def __init__(self, connection: Any, *args: Any, **kwargs: Any) -> None:
        topts = connection.client.transport_options
        name = topts.get("master_name")
        if not isinstance(name, str) or not name:
            raise InvalidOptionError(
                "master_name",
                name,
                "the name of the master the sentinels monitor (emq+sentinel:// needs it)",
            )
        others = topts.get("min_other_sentinels", 0)
        if isinstance(others, bool) or not isinstance(others, int) or others < 0:
            raise InvalidOptionError("min_other_sentinels", others, "an integer >= 0")
        skw = topts.get("sentinel_kwargs")
        if skw is not None and not isinstance(skw, dict):
            raise InvalidOptionError("sentinel_kwargs", skw, "a dict of connection arguments")
        self._sentinels: list[Sentinel] = []
        self._pools: list[MasterFollowingPool] = []
        super().__init__(connection, *args, **kwargs)

    @property
    def target(self) -> BrokerTarget:
        target: BrokerTarget = self.connection.target
        return target

    def _get_pool(self, asynchronous: bool = False) -> Any:
        params = self._connparams(asynchronous=asynchronous)
        self.keyprefix_fanout = self.keyprefix_fanout.format(db=params["db"])
        return self._master_pool(params)

    def _new_store_client(self) -> Any:
        """A client for the store on a master-following pool of the channel's own."""
        params = self._connparams()
        params["socket_timeout"] = self.store_timeout_s
        self._store_pool = self._master_pool(params)
        return redis.Redis(connection_pool=self._store_pool)

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's parameters for one server, with the URL's database and credentials.

        kombu reads the first sentinel URL's path and credentials only; the
        target read every alternate.
        """
        params = super()._connparams(asynchronous)
        target = self.target
        params["db"] = target.db
        if target.username:
            params["username"] = target.username
        if target.password:
            params["password"] = target.password
        return params

    def _master_pool(self, params: dict[str, Any]) -> Any:
        """A connection pool to the master named ``master_name``, found through the sentinels."""
        params = {k: v for k, v in params.items() if k not in ("host", "port")}
        sentinel = BoundedSentinel(  # type: ignore[no-untyped-call,unused-ignore]
            list(self.target.nodes),
            min_other_sentinels=int(self.min_other_sentinels or 0),
            sentinel_kwargs=sentinel_kwargs(params, self.store_timeout_s, self.sentinel_kwargs),
            **params,
        )
        self._sentinels.append(sentinel)
        client = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]
            self.master_name, redis.Redis, connection_pool_class=MasterFollowingPool
        )
        self._pools.append(client.connection_pool)
        return client.connection_pool

    def _brpop_start(self, timeout: float | None = None) -> None:
        """Send the blocking claim, unless its connection is on a master no longer named."""
        conn = self.client.connection
        pool = self.client.connection_pool
        if conn is not None and conn._sock is not None and isinstance(pool, MasterFollowingPool):
            master = pool.watch()
            if master is not None and (conn.host, conn.port) != tuple(master):
                conn.disconnect()
                raise redis.ConnectionError(
                    f"celery_emq: the sentinels now name {master[0]}:{master[1]} the master "
                    f"of {self.master_name!r}; the consumer reconnects there"
                )
        super()._brpop_start(timeout)

    def close(self) -> None:
        super().close()
        # Their watchers stop, so nothing asks the sentinels for a closed channel
        # (a pool used again starts a watcher again).
        for pool in self._pools:
            pool.watched_in = None
        # The connections to the sentinels themselves; any later use reopens them.
        for sentinel in self._sentinels:
            for client in sentinel.sentinels:
                client.close()
