"""The one way operations open a Celery app's job store: no kombu channel, no worker machinery.

The app's broker URL is read with kombu (its forms and aliases, Celery's
``broker_use_ssl`` and ``broker_transport_options``); the client is the
store's own (:func:`celery_emq.store.connect.connect`): one server, Sentinel
or Cluster, TLS and credentials as the transport's channel connects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

from kombu.utils.imports import symbol_by_name

from celery_emq.errors import EmqError, InvalidBrokerURLError
from celery_emq.options import EmqOptions
from celery_emq.store.connect import Endpoint, connect
from celery_emq.store.jobstore import JobStore
from celery_emq.store.topology import target_of
from celery_emq.transport.transport import Transport

__all__ = ["AppStore", "connect_app", "endpoint_of", "open_store"]


def endpoint_of(conninfo: Any) -> Endpoint:
    """Where a kombu ``Connection``'s broker is (nothing connects).

    Raises:
        EmqError: the broker is not an emq:// transport (or its URL is not served).
    """
    cls = conninfo.get_transport_cls()
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise EmqError(
            f"the broker {conninfo.as_uri()} is not a celery_emq transport "
            "(use an emq:// URL, or broker_transport='celery_emq.transport:Transport')"
        )
    target = target_of(conninfo)
    host = conninfo.hostname or "127.0.0.1"
    path = None
    username, password = conninfo.userid, conninfo.password
    if "://" in host:
        # emq+socket:///path.sock (Sentinel and Cluster name their nodes in the target).
        inner = urlsplit(host)
        path = inner.path if inner.scheme == "socket" else None
        username = unquote(inner.username) if inner.username else None
        password = unquote(inner.password) if inner.password else None
    provider = getattr(conninfo, "credential_provider", None)
    if isinstance(provider, str):
        provider = symbol_by_name(provider)()  # type: ignore[no-untyped-call]
    return Endpoint(
        target,
        host=host,
        port=int(conninfo.port or 6379),
        db=_db(conninfo.virtual_host),
        username=username or None,
        password=password or None,
        path=path,
        ssl=conninfo.ssl or False,
        credential_provider=provider,
        transport_options=dict(conninfo.transport_options or {}),
    )


def _db(virtual_host: Any) -> int:
    """The database number in a URL's path, as kombu's Redis channel reads it."""
    text = str(virtual_host or "").strip("/")
    if not text:
        return 0
    if not text.isdigit():
        raise InvalidBrokerURLError(f"the database must be a number, not {virtual_host!r}")
    return int(text)


def connect_app(app: Any) -> tuple[JobStore, EmqOptions, Callable[[], None]]:
    """Open ``app``'s job store; return it, its options, and what closes its connections.

    Raises:
        EmqError: the app's broker is not an emq:// transport.
        InvalidOptionError: a transport option is out of range.
    """
    conninfo = app.connection_for_write()
    try:
        endpoint = endpoint_of(conninfo)
    finally:
        conninfo.release()
    options = EmqOptions.from_transport_options(endpoint.transport_options)
    store, close = connect(endpoint, options)
    return store, options, close


@contextmanager
def open_store(app: Any) -> Iterator[tuple[JobStore, EmqOptions]]:
    """Open the app's broker and yield its job store and options (closed on exit).

    Raises:
        EmqError: the app's broker is not an emq:// transport.
    """
    store, options, close = connect_app(app)
    try:
        yield store, options
    finally:
        close()


class AppStore:
    """A Celery app's job store, opened on first use and kept open (thread-safe).

    A broker error closes the connection, and the next :meth:`get` opens a new one.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._close: Callable[[], None] | None = None
        self._store: JobStore | None = None

    def get(self) -> JobStore:
        """Return the store, opening the app's broker connection if none is open."""
        with self._lock:
            if self._store is None:
                self._store, _options, self._close = connect_app(self.app)
            return self._store

    def reset(self) -> None:
        """Close the connection (after an error): the next :meth:`get` opens another."""
        with self._lock:
            close, self._close, self._store = self._close, None, None
        if close is not None:
            close()
