"""The retry policy of every Redis client the transport builds.

redis-py's own defaults move between releases: 5.x sends a command once on a
plain connection but three times through a ``RedisCluster``; 6 and later give a
``Redis`` built from an address (a sentinel's client) and a ``RedisCluster`` ten
retries with backoff, so a command to a hung server failed only after eleven
socket timeouts. The transport sets the policy of each client itself:

- a command is sent at most ``command_retries + 1`` times (the transport option,
  0 by default), each attempt at once on a new connection, so its worst case is
  that many socket timeouts (and connect timeouts, when it connects);
- a sentinel is asked once per discovery (the other sentinels are the retry);
  ``retry`` in ``sentinel_kwargs`` overrides that.
"""

from __future__ import annotations

from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

__all__ = ["bound_cluster", "cluster_retry", "connection_retry"]


def connection_retry(retries: int) -> dict[str, Any]:
    """Connection arguments that send a command at most ``retries + 1`` times.

    redis-py 5.x ignores a ``retry`` given without ``retry_on_error``, so both
    are given: the errors a new connection may cure, retried at once.
    """
    return {
        "retry": Retry(NoBackoff(), retries),
        "retry_on_error": [ConnectionError, TimeoutError] if retries else [],
    }


def cluster_retry(retries: int) -> Retry:
    """The ``retry`` of a ``RedisCluster`` that sends a command at most ``retries + 1`` times.

    The cluster refreshes its slot table between attempts; its nodes'
    connections never retry on their own (redis-py sets that).
    """
    return Retry(NoBackoff(), retries)


def bound_cluster(client: RedisCluster, retries: int) -> RedisCluster:
    """Make a ``RedisCluster`` built with ``cluster_retry(retries)`` keep that bound on 5.x too.

    redis-py 6 and later count a command's attempts by the ``retry`` object;
    5.x by ``cluster_error_retry_attempts`` (3 by default), which 6 and later
    deprecate as an argument: the attribute is set after construction, where
    5.x reads it (its pipelines copy it when they are made).
    """
    client.cluster_error_retry_attempts = retries  # type: ignore[attr-defined]
    return client
