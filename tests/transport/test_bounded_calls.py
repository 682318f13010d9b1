"""Every Redis call the transport makes has a known worst case.

Each kind of client the transport builds (kombu's, the store's, the Cluster's,
the sentinels') sends a command at most ``command_retries + 1`` times, on every
redis-py release supported (the compat sessions run this module on redis-py's
floor); a command to a hung (SIGSTOPped) server fails after that many socket
timeouts, not eleven.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection
from redis.exceptions import RedisClusterException

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.store.discovery import BoundedSentinel, sentinel_kwargs
from celery_emq.store.retries import CLUSTER_RETRIES, connection_retry
from tests.faults.servers import REDIS_SERVER, RedisServer
from tests.topology.cluster_servers import Node, _free_ports

#: A lease of 3 s: the store's socket timeout is one renewal interval, 1 s.
LEASE_MS = 3000
STORE_TIMEOUT_S = 1.0


def retries_of_connection(pool: Any) -> int:
    """How many times a connection of ``pool`` sends a failed command again."""
    conn = pool.make_connection()
    try:
        if not conn.retry_on_error:
            # redis-py retries no error outside retry_on_error (on 5.x, it
            # replaces a retry given without them by one that never retries).
            return 0
        return retries_of(conn.retry)
    finally:
        conn.disconnect()


def retries_of(retry: Any) -> int:
    """A ``Retry``'s retries (redis-py 5.0 has no ``get_retries``)."""
    get = getattr(retry, "get_retries", None)
    return int(get() if get else retry._retries)


def retries_of_cluster(client: Any) -> tuple[int, bool, int]:
    """A RedisCluster's retries (6+: retry; 5.x: attempts), whether timeouts are among
    the errors retried, and its pipelines' retries."""
    by_retry = retries_of(client.retry)
    assert client.cluster_error_retry_attempts == by_retry
    pipe = client.pipeline()
    assert pipe.cluster_error_retry_attempts == retries_of(pipe.retry)
    timeouts = redis.TimeoutError in type(client).ERRORS_ALLOW_RETRY
    return by_retry, timeouts, retries_of(pipe.retry)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    s = RedisServer(tmp_path / "redis")
    s.start()
    yield s
    assert s.proc is not None
    s.proc.send_signal(signal.SIGCONT)
    s.stop()


@pytest.fixture(scope="module")
def cluster_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    """A two-node Redis Cluster: a master holding every slot, and its replica."""
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    workdir = tmp_path_factory.mktemp("cluster")
    nodes = [Node(port, workdir / str(port)) for port in _free_ports(2)]
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + 20
        first, second = (node.client() for node in nodes)
        while True:
            try:
                first.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
                second.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the cluster nodes did not start"
                time.sleep(0.05)
        master_id = first.execute_command("CLUSTER", "MYID")
        while True:
            try:
                second.execute_command("CLUSTER", "REPLICATE", master_id)
                break
            except redis.ResponseError:
                # Not yet met (unknown node).
                assert time.monotonic() < deadline, "the nodes did not meet"
                time.sleep(0.05)
        for client in (first, second):
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the cluster did not come up"
                time.sleep(0.05)
        # The slot table lists a replica once it has replicated a write.
        while len(first.execute_command("CLUSTER", "SLOTS")[0]) < 4:
            assert time.monotonic() < deadline, "the master does not list its replica"
            first.set("emq-test-sync", 1)
            time.sleep(0.05)
        first.close()
        second.close()
        yield nodes
    finally:
        for node in nodes:
            if node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)
            node.stop()


def cluster_url(nodes: list[Node]) -> str:
    return ";".join(f"emq+cluster://127.0.0.1:{node.port}" for node in nodes) + "/0"


def hung_for(client: Any, proc: Any, pipeline: bool = False) -> float:
    """SIGSTOP the server, send one command (or a pipeline); return how long it took to fail."""
    proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        if pipeline:
            with pytest.raises((redis.ConnectionError, redis.TimeoutError, RedisClusterException)):
                with client.pipeline(transaction=False) as pipe:
                    pipe.get("k")
                    pipe.get("k2")
                    pipe.execute()
            return time.monotonic() - t0
        # A cluster that finds no node answering when it refreshes its slots
        # raises RedisClusterException (a connection error to the transport).
        with pytest.raises((redis.ConnectionError, redis.TimeoutError, RedisClusterException)):
            client.get("k")
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("retries", [None, 1])
def test_each_client_of_one_server_retries_as_told(
    server: RedisServer, retries: int | None
) -> None:
    topts: dict[str, Any] = {"lease_ms": LEASE_MS, "socket_timeout": STORE_TIMEOUT_S}
    if retries is not None:
        topts["command_retries"] = retries
    conn = Connection(f"emq://127.0.0.1:{server.port}/0", transport_options=topts)
    try:
        channel: Any = conn.default_channel
        expected = retries or 0
        assert retries_of_connection(channel.pool) == expected
        assert retries_of_connection(channel.async_pool) == expected
        store_client = channel.store.client
        assert retries_of_connection(store_client.connection_pool) == expected
        assert store_client.ping()
        took = hung_for(store_client, server.proc)
        attempts = expected + 1
        assert attempts * STORE_TIMEOUT_S * 0.9 <= took < attempts * STORE_TIMEOUT_S + 0.9, took
    finally:
        conn.release()


def test_the_cluster_client_sends_a_command_once_by_default(cluster_nodes: list[Node]) -> None:
    conn = Connection(cluster_url(cluster_nodes), transport_options={"lease_ms": LEASE_MS})
    try:
        channel: Any = conn.default_channel
        cluster = channel.store.client
        # Errors that cost no timeout ride a failover; a timeout is not retried.
        assert retries_of_cluster(cluster) == (CLUSTER_RETRIES, False, 0)
        node = cluster.get_redis_connection(cluster.get_nodes()[0])
        assert retries_of_connection(node.connection_pool) == 0
        assert cluster.ping()
        # The master of every slot hangs; the other node answers the slot
        # table's refresh, which names the hung master again.
        took = hung_for(cluster, cluster_nodes[0].proc)
        assert STORE_TIMEOUT_S * 0.9 <= took < STORE_TIMEOUT_S + 0.9, took
        # A pipeline is sent once; redis-py then refreshes the slot table,
        # asking the hung node too (a timeout each time it asks it).
        took = hung_for(cluster, cluster_nodes[0].proc, pipeline=True)
        assert STORE_TIMEOUT_S * 0.9 <= took < 3 * STORE_TIMEOUT_S + 0.9, took
    finally:
        conn.release()


def test_the_cluster_client_retries_as_told(cluster_nodes: list[Node]) -> None:
    conn = Connection(
        cluster_url(cluster_nodes), transport_options={"lease_ms": LEASE_MS, "command_retries": 2}
    )
    try:
        assert retries_of_cluster(conn.default_channel.store.client) == (
            CLUSTER_RETRIES + 2,
            True,
            2,
        )
    finally:
        conn.release()


def test_the_sentinels_are_asked_once_with_the_transports_timeouts() -> None:
    params = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0, "db": 3, "password": "p"}
    params.update(connection_retry(3))
    kwargs = sentinel_kwargs(params, STORE_TIMEOUT_S, None)
    # The sentinels answer within the store's timeout, once each; the master's
    # own database and credentials are not theirs.
    assert kwargs["socket_timeout"] == STORE_TIMEOUT_S
    assert kwargs["socket_connect_timeout"] == 5.0
    assert "db" not in kwargs and "password" not in kwargs
    sentinel = BoundedSentinel([("127.0.0.1", 1), ("127.0.0.1", 2)], sentinel_kwargs=kwargs)
    for client in sentinel.sentinels:
        assert retries_of_connection(client.connection_pool) == 0
        assert client.connection_pool.connection_kwargs["socket_timeout"] == STORE_TIMEOUT_S


def test_a_users_sentinel_kwargs_are_merged_over_the_transports() -> None:
    params = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
    kwargs = sentinel_kwargs(params, 2.0, {"password": "s3cret", "socket_connect_timeout": 1.0})
    assert kwargs["password"] == "s3cret"
    assert kwargs["socket_connect_timeout"] == 1.0
    assert kwargs["socket_timeout"] == 2.0
    assert (
        retries_of_connection(
            BoundedSentinel([("h", 1)], sentinel_kwargs=kwargs).sentinels[0].connection_pool
        )
        == 0
    )
    kwargs = sentinel_kwargs(params, 2.0, {"socket_timeout": 7.0, **connection_retry(1)})
    assert kwargs["socket_timeout"] == 7.0
    assert (
        retries_of_connection(
            BoundedSentinel([("h", 1)], sentinel_kwargs=kwargs).sentinels[0].connection_pool
        )
        == 1
    )
