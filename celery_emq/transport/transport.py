"""The kombu transport: ``emq://`` (``emqs://`` for TLS) and its Sentinel and Cluster forms.

The URL names the deployment; the transport picks the channel that serves it
(:class:`~celery_emq.transport.channel.Channel`, its Sentinel or Cluster
subclass).
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from celery_emq.errors import InvalidBrokerURLError
from celery_emq.store.topology import FORMS, BrokerTarget, target_of
from celery_emq.transport.channel import Channel
from celery_emq.transport.cluster import ClusterChannel
from celery_emq.transport.process import transport_started
from celery_emq.transport.sentinel import SentinelChannel

__all__ = ["Transport"]


class Transport(kombu_redis.Transport):
    """The ``emq://`` transport (``emqs://`` for TLS)."""

    Channel = Channel
    driver_name = "emq"
    # kombu reads these from the class. A cluster in transition (CLUSTERDOWN
    # while a master fails over, TRYAGAIN while slots move) is a connection
    # error: a publish is retried. The consumer's own passes meet these per
    # queue and never raise them (see ClusterChannel): only a cluster where no
    # master answers makes Celery reconnect. A single server never answers so.
    connection_errors = (
        *kombu_redis.Transport.connection_errors,
        redis.exceptions.ClusterError,
        redis.exceptions.TryAgainError,
        # No node of a cluster answers, or none serves a slot (SlotNotCoveredError).
        redis.exceptions.RedisClusterException,
    )
    implements = kombu_redis.Transport.implements.extend(batch_publish=True)

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        # Read the URL before anything connects: a form kombu does not know
        # would otherwise connect to localhost:6379.
        self.target = target_of(client)
        self.Channel = _channel_class(self.target)
        super().__init__(client, *args, **kwargs)
        # A worker builds its transport (for its banner) before it forks its
        # pool: the probes installed now are inherited by every pool process.
        transport_started()
        # Flower builds one to name the broker before it reads queue lengths:
        # Flower support registers then (``import celery_emq`` registers with
        # Flower only if Flower was loaded first, which the order Celery loads
        # its command plugins in decides).

    @property
    def supports_batch_publish(self) -> bool:
        """Batches are safe to send again (see batch.py), whatever the retry options."""
        return True


def _channel_class(target: BrokerTarget) -> type[Channel]:
    """The channel class serving a broker URL's deployment."""
    if target.kind == "single":
        return Channel
    if target.kind == "sentinel":
        return SentinelChannel
    if target.kind == "cluster":
        return ClusterChannel
    raise InvalidBrokerURLError(
        f"Redis {target.kind} (emq+{target.kind}://) is not available in this build; "
        f"the forms served are {FORMS}"
    )
