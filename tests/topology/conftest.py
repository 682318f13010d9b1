"""Fixtures for the topology tests: a Sentinel deployment of private servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.servers import REDIS_SERVER

from .conftest_cluster import cluster_client, cluster_prefix, redis_cluster  # noqa: F401
from .sentinel_servers import SentinelTopology


@pytest.fixture(scope="module")
def sentinel_topology() -> Iterator[SentinelTopology]:
    """A master, a replica and three sentinels for the module's tests (not to be failed over)."""
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    with SentinelTopology() as topo:
        yield topo


@pytest.fixture
def own_sentinel_topology() -> Iterator[SentinelTopology]:
    """A Sentinel deployment of the test's own, which it may fail over."""
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    with SentinelTopology() as topo:
        yield topo
