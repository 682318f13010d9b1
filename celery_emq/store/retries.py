"""The retry policy of every Redis client the transport builds.

redis-py's own defaults move between releases: 5.x sends a command once on a
plain connection but three times through a ``RedisCluster``; 6 and later give a
``Redis`` built from an address (a sentinel's client) and a ``RedisCluster`` ten
retries with backoff, so a command to a hung server failed only after eleven
socket timeouts. The transport sets the policy of each client itself:

- a command is sent at most ``command_retries + 1`` times (the transport option,
  0 by default), each attempt at once on a new connection, so its worst case is
  that many socket timeouts (and connect timeouts, when it connects);
- on a Cluster, errors that cost no timeout (a refused connection,
  ``CLUSTERDOWN`` during a failover) are retried :data:`CLUSTER_RETRIES` times
  more, each after a refresh of the slot table (:class:`BoundedRedisCluster`);
- a sentinel is asked once per discovery (the other sentinels are the retry);
  ``retry`` in ``sentinel_kwargs`` overrides that.
"""

from __future__ import annotations

import functools
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

__all__ = [
    "CLUSTER_RETRIES",
    "BoundedRedisCluster",
    "bound_cluster",
    "cluster_class",
    "cluster_retry",
    "connection_retry",
]


def connection_retry(retries: int) -> dict[str, Any]:
    """Connection arguments that send a command at most ``retries + 1`` times.

    redis-py 5.x ignores a ``retry`` given without ``retry_on_error``, so both
    are given: the errors a new connection may cure, retried at once.
    """
    return {
        "retry": Retry(NoBackoff(), retries),
        "retry_on_error": [ConnectionError, TimeoutError] if retries else [],
    }


#: How many times a Cluster command is sent again after an error that costs no
#: timeout (redis-py's own count): rides a failover's ``CLUSTERDOWN`` window.
CLUSTER_RETRIES = 10


class BoundedRedisCluster(RedisCluster):
    """A ``RedisCluster`` that never sends a command again after a timeout.

    Between attempts the cluster refreshes its slot table, so a command whose
    master died (the connection is refused) or whose slot has no master yet
    (``CLUSTERDOWN``, after which redis-py waits 0.25 s) is sent again, up to
    :data:`CLUSTER_RETRIES` times plus ``command_retries``: that is how a
    command rides a failover. A timeout (a hung or unreachable node) is
    retried only ``command_retries`` times, and a pipeline (several nodes at
    once) is sent once, or ``command_retries + 1`` times, whatever failed.
    """

    ERRORS_ALLOW_RETRY = tuple(  # type: ignore[assignment]
        e for e in RedisCluster.ERRORS_ALLOW_RETRY if e is not TimeoutError
    )
    #: ``command_retries``, set on the subclass made for it (see :func:`cluster_class`).
    command_retries = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)  # type: ignore[no-untyped-call]
        # redis-py 6+ counts a pipeline's attempts by its retry, 5.x by this.
        pipe.retry = Retry(NoBackoff(), self.command_retries)
        pipe.cluster_error_retry_attempts = self.command_retries
        return pipe


@functools.cache
def cluster_class(retries: int) -> type[BoundedRedisCluster]:
    """The ``RedisCluster`` class for ``command_retries = retries``."""
    if not retries:
        return BoundedRedisCluster
    # A timeout counts among the errors retried: the check reads the class.
    return type(
        "RetryingRedisCluster",
        (BoundedRedisCluster,),
        {"ERRORS_ALLOW_RETRY": RedisCluster.ERRORS_ALLOW_RETRY, "command_retries": retries},
    )


def cluster_retry(retries: int) -> Retry:
    """The ``retry`` of a :class:`BoundedRedisCluster` (``command_retries = retries``).

    Its nodes' connections never retry on their own (redis-py sets that).
    """
    return Retry(NoBackoff(), CLUSTER_RETRIES + retries)


def bound_cluster(client: RedisCluster, retries: int) -> RedisCluster:
    """Make a ``RedisCluster`` built with ``cluster_retry(retries)`` keep that bound on 5.x too.

    redis-py 6 and later count a command's attempts by the ``retry`` object;
    5.x by ``cluster_error_retry_attempts`` (3 by default), which 6 and later
    deprecate as an argument: the attribute is set after construction, where
    5.x reads it (its pipelines copy it when they are made).
    """
    client.cluster_error_retry_attempts = retries  # type: ignore[attr-defined]
    return client
