"""Flower support: teach Flower's broker client the ``emq://`` and ``emqs://`` schemes.

Flower picks its broker client by URL scheme. :func:`register` adds ours, whose
queue lengths come from the job store: ``messages_ready`` is what is pending
(lanes included), ``messages_unacknowledged`` what is leased, ``messages`` both,
and ``messages_dead`` (API only) what is in the morgue.

It also attaches to each Flower application (:class:`flower.app.Flower`, built
before or after :func:`register` runs): the morgue page at ``/emq``
(:mod:`celery_emq.morgue_page`), and the Prometheus collector
(:mod:`celery_emq.metrics`) in ``prometheus_client``'s default registry, which
Flower's own ``/metrics`` serves. Both read the store of the Flower's Celery app.

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

from .keys import QueueKeys
from .options import EmqOptions
from .scripts import Scripts, read_tally, script_source
from .store import LANE_PAGE

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

        async def queues(self, names: list[str]) -> list[dict[str, Any]]:
            names = list(names)
            keys = [QueueKeys(self.key_prefix, n) for n in names]
            try:
                # One tally script call per queue (and per LANE_PAGE lanes), one round trip.
                tally = self.redis.register_script(script_source("tally"))
                async with self.redis.pipeline() as pipe:
                    for k in keys:
                        await tally(Scripts.tally_keys(k), [0, LANE_PAGE, 0], client=pipe)
                    replies = await pipe.execute()
                out = []
                for name, k, reply in zip(names, keys, replies, strict=True):
                    counts, page = read_tally(reply)
                    lane_sizes = [n for _, n, _ in page]
                    while len(lane_sizes) < counts["lanes"] and len(page) == LANE_PAGE:
                        more = [len(lane_sizes), LANE_PAGE, 0]
                        page = read_tally(await tally(Scripts.tally_keys(k), more))[1]
                        lane_sizes += [n for _, n, _ in page]
                    pending = counts["pending"] + sum(lane_sizes)
                    out.append(
                        {
                            "name": name,
                            "messages": pending + counts["active"],
                            "messages_ready": pending,
                            "messages_unacknowledged": counts["active"],
                            "messages_dead": counts["dead"],
                            "messages_delayed": counts["delayed"],
                        }
                    )
                return out
            finally:
                await self.redis.aclose()

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

    original = fb.Broker.__new__

    def __new__(cls: type, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        scheme = urlparse(broker_url).scheme
        if scheme == "emqs" or (scheme == "emq" and kwargs.get("broker_use_ssl")):
            return EmqsBroker(broker_url, *args, **kwargs)
        if scheme == "emq":
            return EmqBroker(broker_url, *args, **kwargs)
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
    """Add the morgue page and the metrics collector to one Flower application."""
    global _collector
    with _lock:
        if getattr(flower_app, "emq_store", None) is not None:
            return
        from .metrics import AppStore
        from .morgue_page import handlers

        flower_app.emq_store = AppStore(flower_app.capp)
        prefix = "/" + (getattr(flower_app.options, "url_prefix", "") or "").strip("/")
        routes = [(prefix.rstrip("/") + path, handler) for path, handler in handlers()]
        # Rules added now are matched before Flower's own (and its catch-all 404).
        flower_app.add_handlers(r".*", routes)
        if _collector is None:
            try:
                from prometheus_client import REGISTRY

                from .metrics import EmqCollector
            except ImportError:  # pragma: no cover - Flower itself depends on prometheus_client
                logger.warning("prometheus_client is missing: no emq metrics in Flower")
                return
            _collector = EmqCollector(flower_app.emq_store)
            REGISTRY.register(_collector)


def register_if_loaded() -> None:
    """Register with Flower only if Flower is already imported (no import of our own)."""
    if "flower.utils.broker" in sys.modules:
        register()
