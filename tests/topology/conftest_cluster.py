"""Fixtures for tests on a Redis Cluster the test session starts (see cluster_servers.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from redis.cluster import ClusterNode, RedisCluster

from .cluster_servers import Cluster


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """Three masters with one replica each, shared by the session's tests (never killed)."""
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_client(redis_cluster: Cluster) -> Iterator[RedisCluster]:
    """A RedisCluster client on the session's cluster."""
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in redis_cluster.ports])
    yield client
    client.close()


@pytest.fixture
def cluster_prefix(cluster_client: RedisCluster) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted afterwards."""
    p = f"t{uuid.uuid4().hex[:10]}:"
    yield p
    for node in cluster_client.get_primaries():
        conn = cluster_client.get_redis_connection(node)
        keys = list(conn.scan_iter(match=p + "*", count=1000))
        for key in keys:
            conn.delete(key)
