"""An ``emq://`` broker for pytest-celery's Docker test setups.

pytest-celery (the ``docker`` extra: ``pip install "celery-emq[docker]"``) runs
brokers, backends and workers in containers. :class:`EmqTestBroker` is its Redis
broker container seen through ``emq://``: the same ``redis`` image, with the
URLs pytest-celery hands to the app and to the worker containers rewritten to
this transport's scheme. In the project's ``conftest.py``::

    from pytest_celery import CeleryBrokerCluster

    pytest_plugins = ["celery_emq.testing.docker"]

    @pytest.fixture
    def celery_broker_cluster(celery_emq_broker):
        cluster = CeleryBrokerCluster(celery_emq_broker)
        yield cluster
        cluster.teardown()

The worker image must have ``celery-emq`` installed and its app module must
``import celery_emq`` (that registers the ``emq://`` scheme).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

try:
    from pytest_celery import RedisTestBroker
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'celery_emq.testing.docker needs pytest-celery: pip install "celery-emq[docker]"'
    ) from exc

__all__ = ["EmqTestBroker", "celery_emq_broker", "emq_url"]

#: Each Redis URL scheme and the emq scheme that speaks to the same server.
_SCHEMES = {"redis://": "emq://", "rediss://": "emqs://"}


def emq_url(url: str) -> str:
    """Return a ``redis://`` (or ``rediss://``) URL as ``emq://`` (``emqs://``)."""
    for redis_scheme, emq_scheme in _SCHEMES.items():
        if url.startswith(redis_scheme):
            return emq_scheme + url[len(redis_scheme) :]
    return url


class EmqTestBroker(RedisTestBroker):  # type: ignore[misc]
    """pytest-celery's Redis broker node, handing out ``emq://`` URLs."""

    def config(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The node's Celery configuration: ``url`` and ``host_url`` in ``emq://``."""
        config: dict[str, Any] = dict(super().config(*args, **kwargs))
        for key in ("url", "host_url"):
            if isinstance(config.get(key), str):
                config[key] = emq_url(config[key])
        return config


@pytest.fixture
def celery_emq_broker(default_redis_broker: Any) -> Iterator[EmqTestBroker]:
    """An :class:`EmqTestBroker` on pytest-celery's Redis container; torn down after."""
    broker = EmqTestBroker(default_redis_broker)
    yield broker
    broker.teardown()
