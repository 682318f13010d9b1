"""Opening a job store without a kombu channel: one server, Sentinel or Cluster.

What the CLI, the metrics exporter, Flower's page, the sweep task and the
pytest plugin use to reach the store. The client is built as the transport's
channel builds the store's own (see :mod:`celery_emq.transport.channel`,
``sentinel`` and ``cluster``): the same socket timeouts (the store's bounded by
one renewal interval), TCP keepalive, retry policy (:mod:`.retries`), TLS and
credentials; the sentinels are asked as :mod:`.discovery` says; a cluster's
client bounds its retries as :class:`~.retries.BoundedRedisCluster` does.

:class:`Endpoint` says where the server is, as the broker URL reads (the layer
above reads the URL with kombu, which the store does not import).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from celery_emq.errors import InvalidOptionError
from celery_emq.options import EmqOptions
from celery_emq.store.discovery import BoundedSentinel, sentinel_kwargs
from celery_emq.store.jobstore import JobStore
from celery_emq.store.retries import (
    CLUSTER_RETRIES,
    bound_cluster,
    cluster_class,
    cluster_retry,
    connection_retry,
)
from celery_emq.store.topology import BrokerTarget

__all__ = [
    "KEEPALIVE_OPTIONS",
    "SOCKET_CONNECT_TIMEOUT_S",
    "SOCKET_TIMEOUT_S",
    "Endpoint",
    "cluster_client",
    "connect",
    "store_timeout_s",
]

#: The transport's default socket timeouts (kombu's are None: no wait is unbounded here).
SOCKET_CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 10.0
#: TCP keepalive on every connection: a peer that vanished without closing the
#: connection is noticed after about 10 + 3 x 5 s of silence, not hours.
KEEPALIVE_OPTIONS: dict[int, int] = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}
#: kombu's defaults for the connection options the store's client takes too.
_POOL_DEFAULTS: dict[str, Any] = {"max_connections": 10, "health_check_interval": 25}


@dataclass(frozen=True)
class Endpoint:
    """Where a broker URL's server is, and how to reach it.

    ``target`` says which deployment (:func:`~.topology.target_of`); for one
    server, ``host``/``port`` or a Unix socket ``path``, and ``db``. Sentinel
    and Cluster take their nodes, database and credentials from ``target``
    (``username``/``password`` fill in what it lacks).
    """

    target: BrokerTarget
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    path: str | None = None
    #: ``broker_use_ssl``: True, or a dict of redis-py ``ssl_*`` arguments.
    ssl: bool | dict[str, Any] = False
    #: A ``redis.CredentialProvider`` (in place of username and password).
    credential_provider: Any = None
    #: The broker's transport options (socket, pool and sentinel options).
    transport_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        """Whether connections use TLS (an ``emqs`` URL, or ``broker_use_ssl``)."""
        return self.target.tls or bool(self.ssl)


def store_timeout_s(options: EmqOptions, socket_timeout: float | None) -> float:
    """The store's socket timeout: one renewal interval, from 1 to 5 s.

    A renewal stuck on a dead connection must fail in time for the keeper to
    retry on a fresh one before the lease lapses. With ``wait_replicas`` it is
    at least ``wait_timeout_ms`` + 0.5 s, so a ``WAIT`` can run out.
    """
    bound = max(1.0, min(5.0, options.renew_interval_ms / 1000))
    timeout = min(float(socket_timeout), bound) if socket_timeout else bound
    if options.wait_replicas:
        # A publish or settle may block in WAIT for wait_timeout_ms: its
        # reply must not be cut off (it would read as a failed write).
        timeout = max(timeout, options.wait_timeout_ms / 1000 + 0.5)
    return timeout


def connect(endpoint: Endpoint, options: EmqOptions) -> tuple[JobStore, Callable[[], None]]:
    """Open a job store on ``endpoint``; return it and what closes its connections.

    A single server or Sentinel connects on the store's first command; a
    cluster's client reads the slot table from a seed node at once.

    Raises:
        InvalidOptionError: a Sentinel URL without ``master_name``.
        redis.ConnectionError: no seed node of a cluster answers.
    """
    topts = endpoint.transport_options
    timeout_s = store_timeout_s(options, topts.get("socket_timeout", SOCKET_TIMEOUT_S))
    kind = endpoint.target.kind
    if kind == "cluster":
        cluster = cluster_client(endpoint, options.command_retries, timeout_s)
        return _store(cluster, options), cluster.close
    params = _server_params(endpoint, options, timeout_s)
    if kind == "sentinel":
        return _sentinel_store(endpoint, options, params, timeout_s)
    pool = redis.ConnectionPool(**params)
    return _store(redis.Redis(connection_pool=pool), options), pool.disconnect


def _store(client: Any, options: EmqOptions) -> JobStore:
    return JobStore(
        client, options.key_prefix, options.lease_ms, options.wait_replicas, options.wait_timeout_ms
    )


def _server_params(endpoint: Endpoint, options: EmqOptions, timeout_s: float) -> dict[str, Any]:
    """redis-py connection arguments for one server, as kombu's channel builds them."""
    topts = endpoint.transport_options
    target = endpoint.target
    params: dict[str, Any] = {
        "host": endpoint.host,
        "port": endpoint.port,
        "db": target.db if target.kind == "sentinel" else endpoint.db,
        "username": target.username or endpoint.username,
        "password": target.password or endpoint.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": topts.get("socket_connect_timeout", SOCKET_CONNECT_TIMEOUT_S),
        "socket_keepalive": topts.get("socket_keepalive", True),
        "socket_keepalive_options": topts.get("socket_keepalive_options", KEEPALIVE_OPTIONS),
        "client_name": topts.get("client_name"),
    }
    for name, default in _POOL_DEFAULTS.items():
        params[name] = topts.get(name, default)
    if endpoint.credential_provider is not None:
        params["credential_provider"] = endpoint.credential_provider
        params.pop("username")
        params.pop("password")
    if endpoint.tls:
        params["connection_class"] = redis.SSLConnection
        if isinstance(endpoint.ssl, dict):
            params.update(endpoint.ssl)
    if endpoint.path is not None and target.kind == "single":
        for name in ("host", "port", "socket_connect_timeout", "socket_keepalive"):
            params.pop(name)
        params.pop("socket_keepalive_options")
        params.update(path=endpoint.path, connection_class=redis.UnixDomainSocketConnection)
    params.update(connection_retry(options.command_retries))
    return params


def _sentinel_store(
    endpoint: Endpoint, options: EmqOptions, params: dict[str, Any], timeout_s: float
) -> tuple[JobStore, Callable[[], None]]:
    """A store on the master the sentinels name (asked again on every reconnect)."""
    topts = endpoint.transport_options
    name = topts.get("master_name")
    if not isinstance(name, str) or not name:
        raise InvalidOptionError(
            "master_name",
            name,
            "the name of the master the sentinels monitor (emq+sentinel:// needs it)",
        )
    params = {k: v for k, v in params.items() if k not in ("host", "port")}
    params["connection_class"] = (
        SentinelManagedSSLConnection if endpoint.tls else SentinelManagedConnection
    )
    sentinel = BoundedSentinel(  # type: ignore[no-untyped-call,unused-ignore]
        list(endpoint.target.nodes),
        min_other_sentinels=int(topts.get("min_other_sentinels") or 0),
        sentinel_kwargs=sentinel_kwargs(params, timeout_s, topts.get("sentinel_kwargs")),
        **params,
    )
    client = sentinel.master_for(name, redis.Redis)  # type: ignore[no-untyped-call,unused-ignore]

    def close() -> None:
        client.connection_pool.disconnect()
        for each in sentinel.sentinels:
            each.close()

    return _store(client, options), close


def cluster_client(endpoint: Endpoint, retries: int, socket_timeout_s: float) -> RedisCluster:
    """A ``RedisCluster`` over the URL's seed nodes, retrying as :mod:`.retries` says.

    Raises:
        redis.ConnectionError: no seed node answers.
    """
    topts = endpoint.transport_options
    target = endpoint.target
    kwargs: dict[str, Any] = {
        "startup_nodes": [
            ClusterNode(host, port)  # type: ignore[no-untyped-call,unused-ignore]
            for host, port in target.nodes
        ],
        "username": target.username or endpoint.username,
        "password": target.password or endpoint.password,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": topts.get("socket_connect_timeout", SOCKET_CONNECT_TIMEOUT_S),
        "socket_keepalive": topts.get("socket_keepalive", True),
        "socket_keepalive_options": topts.get("socket_keepalive_options", KEEPALIVE_OPTIONS),
    }
    if topts.get("client_name") is not None:
        kwargs["client_name"] = topts["client_name"]
    if endpoint.tls:
        kwargs["ssl"] = True
        if isinstance(endpoint.ssl, dict):
            kwargs.update(endpoint.ssl)
    try:
        cluster = cluster_class(retries)(retry=cluster_retry(retries), **kwargs)
        return bound_cluster(cluster, CLUSTER_RETRIES + retries)
    except RedisClusterException as exc:
        raise redis.ConnectionError(str(exc)) from exc
