"""Flower support: teach Flower's broker client the ``emq://`` schemes (and TLS, Sentinel).

Flower picks its broker client by URL scheme. :func:`register` adds ours, whose
queue lengths come from the job store: ``messages_ready`` is what is pending
(lanes included), ``messages_unacknowledged`` what is leased, ``messages`` both,
and ``messages_dead`` (API only) what is in the morgue.

It also attaches to each Flower application (:class:`flower.app.Flower`, built
before or after :func:`register` runs): the morgue page at ``/emq``
(:mod:`celery_emq.ops.morgue_page`) and the Prometheus series
(:mod:`celery_emq.ops.metrics`) at ``/emq/metrics``, both behind Flower's
authentication. A Flower without authentication also serves the series on its
own ``/metrics`` (the collector joins ``prometheus_client``'s default registry);
one with authentication keeps its ``/metrics`` to Flower's own series, which it
serves to anyone. Both read the store of the Flower's Celery app.

``import celery_emq`` calls :func:`register` when Flower is already loaded, and
the first emq:// connection in the process calls it otherwise, which covers
``celery -A app flower``; call it yourself if you start Flower some other way.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import threading
from typing import Any
from urllib.parse import urlparse

from celery_emq.errors import InvalidOptionError
from celery_emq.options import EmqOptions
from celery_emq.store.tally_async import AsyncTally
from celery_emq.store.topology import BrokerTarget, target_of

__all__ = ["register"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: The collector registered in prometheus_client's default registry (one per process).
_collector: Any = None


def register() -> bool:
    """Add the emq schemes to Flower's broker factory; return whether Flower is there."""
    try:
        from flower.utils import broker as fb
    except ImportError:
        return False
    if getattr(fb.Broker, "_emq_registered", False):
        return True

    class EmqQueues:
        """Queue lengths read from the job store (mixed into Flower's Redis clients)."""

        redis: Any
        key_prefix: str

        def _emq_init(self, kwargs: dict[str, Any]) -> None:
            options = EmqOptions.from_transport_options(kwargs.get("broker_options") or {})
            self.key_prefix = options.key_prefix

        #: Whether the queues' tallies go in one pipeline (not on a cluster).
        pipelined = True

        async def queues(self, names: list[str]) -> list[dict[str, Any]]:
            names = list(names)
            try:
                tally = AsyncTally(self.redis, self.key_prefix, self.pipelined)
                rows = await tally.counts(names)
                return [
                    {
                        "name": name,
                        "messages": counts["pending"] + counts["active"],
                        "messages_ready": counts["pending"],
                        "messages_unacknowledged": counts["active"],
                        "messages_dead": counts["dead"],
                        "messages_delayed": counts["delayed"],
                    }
                    for name, counts in zip(names, rows, strict=True)
                ]
            finally:
                await _close(self.redis)

    class EmqBroker(EmqQueues, fb.Redis):  # type: ignore[misc]
        """Flower's client for ``emq://``."""

        def __init__(self, broker_url: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(broker_url, *args, **kwargs)
            self._emq_init(kwargs)

    class EmqsBroker(EmqQueues, fb.RedisSsl):  # type: ignore[misc]
        """Flower's client for ``emqs://`` (TLS; ``broker_use_ssl`` applies)."""

        def __init__(self, broker_url: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(broker_url, *args, **kwargs)
            self._emq_init(kwargs)

    class EmqSentinelBroker(EmqQueues, fb.RedisBase):  # type: ignore[misc]
        """Flower's client for ``emq+sentinel://`` (``emqs+sentinel://``: TLS).

        Its connections go to the master the sentinels name, so queue lengths
        keep coming after a failover.
        """

        def __init__(self, broker_url: str, *args: Any, **kwargs: Any) -> None:
            # Flower's base class reads one host from the URL: the first sentinel.
            super().__init__(broker_url.split(";", 1)[0], *args, **kwargs)
            self._emq_init(kwargs)
            self.redis, self._sentinel = _sentinel_client(self, broker_url, kwargs)

        async def queues(self, names: list[str]) -> list[dict[str, Any]]:
            try:
                return await super().queues(names)
            finally:
                for client in self._sentinel.sentinels:
                    await _close(client)

    class EmqClusterBroker(EmqQueues, fb.RedisBase):  # type: ignore[misc]
        """Flower's client for ``emq+cluster://`` and ``emqs+cluster://``.

        Flower hands the first seed node of the URL; the cluster client finds
        the others.
        """

        def __init__(self, broker_url: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(broker_url.split(";", 1)[0], *args, **kwargs)
            self._emq_init(kwargs)
            from redis.asyncio.cluster import RedisCluster

            options: dict[str, Any] = {
                "host": self.host or "localhost",
                "port": self.port or 6379,
                "username": self.username,
                "password": self.password,
                "socket_connect_timeout": self.socket_connect_timeout,
                "socket_timeout": self.socket_timeout,
            }
            use_ssl = kwargs.get("broker_use_ssl")
            if urlparse(broker_url).scheme.startswith("emqs") or use_ssl:
                options["ssl"] = True
                if isinstance(use_ssl, dict):
                    options.update(use_ssl)
            self.redis = RedisCluster(**options)
            # Each queue on the master of its slot, all at once.
            self.pipelined = False

    original = fb.Broker.__new__

    def __new__(cls: type, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        scheme = urlparse(broker_url).scheme
        if scheme in ("emq+cluster", "emqs+cluster"):
            return EmqClusterBroker(broker_url, *args, **kwargs)
        if scheme == "emqs" or (scheme == "emq" and kwargs.get("broker_use_ssl")):
            return EmqsBroker(broker_url, *args, **kwargs)
        if scheme == "emq":
            return EmqBroker(broker_url, *args, **kwargs)
        if scheme in ("emq+sentinel", "emqs+sentinel"):
            return EmqSentinelBroker(broker_url, *args, **kwargs)
        return original(cls, broker_url, *args, **kwargs)

    fb.Broker.__new__ = __new__
    fb.Broker._emq_registered = True
    _hook_flower_app()
    return True


def _hook_flower_app() -> None:
    """Attach to every Flower application: those built from now on, and any built already.

    A Flower built before celery_emq was imported (the ``celery`` command may
    load its plugins in either order) is found among the live objects, once.
    """
    try:
        from flower.app import Flower
    except ImportError:
        return
    if not getattr(Flower.__init__, "_emq_attaches", False):
        original = Flower.__init__

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            attach(self)

        __init__._emq_attaches = True  # type: ignore[attr-defined]
        Flower.__init__ = __init__
    for obj in gc.get_objects():
        if isinstance(obj, Flower):
            attach(obj)


def attach(flower_app: Any) -> None:
    """Add the morgue page and the metrics to one Flower application."""
    global _collector
    with _lock:
        if getattr(flower_app, "emq_store", None) is not None:
            return
        from celery_emq.ops.appstore import AppStore
        from celery_emq.ops.morgue_page import FlowerTemplates, handlers, loader_options

        flower_app.emq_store = AppStore(flower_app.capp)
        prefix = "/" + (getattr(flower_app.options, "url_prefix", "") or "").strip("/")
        pages = handlers()
        try:
            from prometheus_client import REGISTRY, CollectorRegistry

            from celery_emq.ops.metrics import EmqCollector
            from celery_emq.ops.metrics_page import MetricsPage
        except ImportError:  # pragma: no cover - Flower itself depends on prometheus_client
            logger.warning("prometheus_client is missing: no emq metrics in Flower")
        else:
            flower_app.emq_metrics = CollectorRegistry()
            flower_app.emq_metrics.register(EmqCollector(flower_app.emq_store))
            pages.append((r"/emq/metrics", MetricsPage))
            # Flower serves /metrics to anyone: the series join it only when
            # Flower lets anyone in anyway.
            if _collector is None and not _authenticates(flower_app):
                _collector = EmqCollector(flower_app.emq_store)
                REGISTRY.register(_collector)
        routes = [(prefix.rstrip("/") + path, handler) for path, handler in pages]
        # Rules added now are matched before Flower's own (and its catch-all 404).
        flower_app.add_handlers(r".*", routes)
        settings = flower_app.settings
        if settings.get("template_path") and "template_loader" not in settings:
            # Flower's menu gets a link to the page.
            settings["template_loader"] = FlowerTemplates(
                settings["template_path"], prefix.rstrip("/") + "/emq", **loader_options(settings)
            )


def _authenticates(flower_app: Any) -> bool:
    """Whether Flower asks who is there (``--basic-auth`` or ``--auth``)."""
    options = flower_app.options
    return bool(getattr(options, "basic_auth", None) or getattr(options, "auth", None))


def _sentinel_client(broker: Any, broker_url: str, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Return an asyncio client of the master the sentinels name, and its ``Sentinel``."""
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel
    from redis.backoff import NoBackoff

    options = kwargs.get("broker_options") or {}
    master_name = options.get("master_name")
    if not master_name:
        raise InvalidOptionError(
            "master_name", master_name, "the name of the master the sentinels monitor"
        )
    target = _sentinel_target(broker_url)
    timeouts = {
        "socket_connect_timeout": broker.socket_connect_timeout,
        "socket_timeout": broker.socket_timeout,
    }
    sentinel_kwargs = {**timeouts, **(options.get("sentinel_kwargs") or {})}
    connection_kwargs: dict[str, Any] = {
        **timeouts,
        "db": target.db,
        "username": target.username,
        "password": target.password,
        "retry": Retry(NoBackoff(), 0),
    }
    use_ssl = kwargs.get("broker_use_ssl")
    if target.tls or use_ssl:
        connection_kwargs["ssl"] = True
        if isinstance(use_ssl, dict):
            connection_kwargs.update(use_ssl)
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
        list(target.nodes),
        min_other_sentinels=int(options.get("min_other_sentinels") or 0),
        sentinel_kwargs=sentinel_kwargs,
        **connection_kwargs,
    )
    return sentinel.master_for(master_name), sentinel


def _sentinel_target(broker_url: str) -> BrokerTarget:
    """The sentinels and database of a Flower broker URL.

    Flower hands the first alternate of the app's URL only (``as_uri``), without
    the database: the app's own URL completes it when it lists that sentinel.
    """
    from kombu.connection import Connection

    target = target_of(Connection(broker_url))  # type: ignore[no-untyped-call,unused-ignore]
    try:
        from celery import current_app

        with current_app.connection_for_read() as conn:
            full = target_of(conn)
    except Exception:
        return target
    if full.kind == "sentinel" and set(target.nodes) <= set(full.nodes):
        return full
    return target


async def _close(client: Any) -> None:
    """Close an asyncio client: ``aclose()``, or ``close()`` on redis-py 5.0.0."""
    aclose = getattr(client, "aclose", None)
    await (aclose() if aclose is not None else client.close())


def register_if_loaded() -> None:
    """Register with Flower only if Flower is already imported (no import of our own)."""
    if "flower.utils.broker" in sys.modules:
        register()
