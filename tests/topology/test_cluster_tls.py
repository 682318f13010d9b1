"""emqs+cluster:// on a Redis Cluster whose every node speaks TLS only."""

from __future__ import annotations

import json
import os
import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from redis.cluster import ClusterNode, RedisCluster, key_slot

import celery_emq  # noqa: F401  (registers emqs+cluster://)
from celery_emq.store.jobstore import JobStore
from celery_emq.store.keys import QueueKeys
from celery_emq.transport.cluster import ClusterChannel
from tests.e2e.app import client_app
from tests.e2e.harness import Worker, wait_for

from .cluster_servers import Cluster, tls_unsupported

#: The machine's Redis: results and the tasks' ledger (never the cluster under test).
LEDGER = os.environ.get("EMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[Cluster]:
    """Three masters and three replicas, TLS on every client, bus and replication link."""
    reason = tls_unsupported()
    if reason is not None:
        pytest.skip(reason)
    cluster = Cluster(tls=True)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def tls_client(tls_cluster: Cluster) -> Iterator[RedisCluster]:
    client = RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", p) for p in tls_cluster.ports],
        ssl=True,
        ssl_ca_certs=str(tls_cluster.ca),
    )
    yield client
    client.close()


@pytest.fixture
def prefix(tls_client: RedisCluster) -> Iterator[str]:
    p = f"t{uuid.uuid4().hex[:10]}:"
    yield p
    for node in tls_client.get_primaries():
        conn = tls_client.get_redis_connection(node)
        for key in list(conn.scan_iter(match=p + "*", count=1000)):
            conn.delete(key)


def verified(cluster: Cluster) -> dict[str, Any]:
    """kombu's ``ssl`` / Celery's ``broker_use_ssl``: verify the nodes against the test CA."""
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(cluster.ca)}


def names_on_masters(cluster: Cluster, prefix: str, n: int) -> list[str]:
    """``n`` queue names whose keys live on ``n`` different masters."""
    names: list[str] = []
    masters: set[int] = set()
    for i in range(1000):
        name = f"tls{i}"
        port = cluster.master_of(QueueKeys(prefix + "emq", name).wake).port
        if port not in masters:
            masters.add(port)
            names.append(name)
            if len(names) == n:
                return names
    raise AssertionError(f"no {n} queues on different masters")


def queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def settled(store: JobStore, names: list[str]) -> list[dict[str, int]]:
    """The queues' counts once batched acks have landed (or after 5 s)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(store.counts(n)["active"] for n in names):
        time.sleep(0.05)
    return [store.counts(n) for n in names]


def test_kombu_publishes_and_consumes_on_every_master_over_tls(
    tls_cluster: Cluster, tls_client: RedisCluster, prefix: str
) -> None:
    names = names_on_masters(tls_cluster, prefix, 3)
    queues = [queue(n) for n in names]
    conn = Connection(
        tls_cluster.url,
        transport_options={"global_keyprefix": prefix},
        ssl=verified(tls_cluster),
    )
    try:
        channel = conn.channel()
        assert isinstance(channel, ClusterChannel)
        producer = Producer(channel)
        for i in range(12):
            q = queues[i % 3]
            producer.publish({"i": i}, exchange=q.exchange, routing_key=q.routing_key, declare=[q])
        got: list[int] = []

        def on_message(body: Any, message: Any) -> None:
            got.append(body["i"])
            message.ack()

        with Consumer(conn.channel(), queues, callbacks=[on_message], accept=["json"]):
            deadline = time.monotonic() + 10
            while len(got) < 12 and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
    finally:
        conn.release()
    assert sorted(got) == list(range(12))
    store = JobStore(tls_client, prefix + "emq", 30_000)
    assert settled(store, names) == [{"pending": 0, "active": 0, "delayed": 0, "dead": 0}] * 3
    assert [store.metrics(n)["completed"] for n in names] == [4, 4, 4]
    assert len({key_slot(store.keys(n).wake.encode()) for n in names}) == 3


def test_a_celery_worker_runs_tasks_on_two_masters_over_tls(
    tls_cluster: Cluster, tls_client: RedisCluster, prefix: str, tmp_path: Path
) -> None:
    names = names_on_masters(tls_cluster, prefix, 2)
    use_ssl = verified(tls_cluster)
    env = {
        "EMQ_E2E_REDIS": LEDGER,
        "EMQ_E2E_PREFIX": prefix,
        "EMQ_E2E_BROKER": tls_cluster.url,
        "EMQ_E2E_BROKER_SSL": json.dumps(use_ssl),
    }
    worker = Worker(
        env, tmp_path / "w.log", "tls", "-P", "threads", "-c", "2", "-Q", ",".join(names)
    )
    app = client_app(LEDGER, prefix, broker=tls_cluster.url)
    app.conf.broker_use_ssl = use_ssl
    ledger = redis.Redis.from_url(LEDGER)
    try:
        worker.wait_ready(40)
        for i in range(10):
            app.send_task("tests.e2e.app.record", args=(i,), queue=names[i % 2])
        wait_for(lambda: ledger.hlen(prefix + "runs") == 10, 20)
        # Remote control: a fanout through pub/sub on a node of the cluster, both ways.
        replies = app.control.ping(timeout=5, limit=1)
        assert [list(r) for r in replies] == [[f"tls@{socket.gethostname()}"]]
        assert worker.warm_stop(30) == 0
    finally:
        worker.kill()
        app.close()
        ledger.delete(prefix + "runs")
        ledger.close()
    store = JobStore(tls_client, prefix + "emq", 30_000)
    assert settled(store, names) == [{"pending": 0, "active": 0, "delayed": 0, "dead": 0}] * 2
    assert [store.metrics(n)["completed"] for n in names] == [5, 5]


def test_an_unverified_cluster_is_refused_with_an_ssl_error(tls_cluster: Cluster) -> None:
    # Verification on, without the test CA: no system CA signed the nodes' certificate.
    conn = Connection(
        tls_cluster.url,
        ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED},
        connect_timeout=2,
        transport_options={"socket_timeout": 2},
    )
    try:
        with pytest.raises(redis.ConnectionError, match=r"(?i)certificate verify failed"):
            conn.channel()
    finally:
        conn.release()


def test_plain_emq_cluster_cannot_talk_to_tls_only_nodes(tls_cluster: Cluster) -> None:
    url = tls_cluster.url.replace("emqs+cluster://", "emq+cluster://")
    conn = Connection(url, connect_timeout=2, transport_options={"socket_timeout": 2})
    started = time.monotonic()
    try:
        with pytest.raises(redis.ConnectionError):
            conn.channel()
    finally:
        conn.release()
    assert time.monotonic() - started < 30


def test_flower_reads_queue_lengths_over_tls(
    tls_cluster: Cluster, tls_client: RedisCluster, prefix: str
) -> None:
    pytest.importorskip("flower")
    import asyncio

    from flower.utils.broker import Broker

    from celery_emq.ops.flower import register

    assert register()
    names = names_on_masters(tls_cluster, prefix, 2)
    store = JobStore(tls_client, prefix + "emq", 30_000)
    for i, name in enumerate(names):
        for j in range(i + 1):
            store.enqueue(name, str(j), "{}")
    store.claim(names[1], "me", 1)
    broker = Broker(
        tls_cluster.url.split(";", 1)[0],
        broker_options={"global_keyprefix": prefix},
        broker_use_ssl=verified(tls_cluster),
    )
    lengths = asyncio.run(broker.queues(names))
    assert [(q["name"], q["messages_ready"], q["messages_unacknowledged"]) for q in lengths] == [
        (names[0], 1, 0),
        (names[1], 1, 1),
    ]


@pytest.mark.parametrize("scheme", ["emqs+cluster", "emq+cluster"])
def test_broker_use_ssl_true_puts_every_connection_on_tls(
    tls_cluster: Cluster, prefix: str, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ssl=True (Celery's broker_use_ssl=True): verify against the default CAs,
    # which OpenSSL reads from SSL_CERT_FILE. The store, the wakers and the
    # pub/sub node's connections must all speak TLS.
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_cluster.ca))
    url = tls_cluster.url.replace("emqs+cluster://", f"{scheme}://")
    exchange = Exchange("bcast", "fanout", durable=False)
    direct = queue(names_on_masters(tls_cluster, prefix, 1)[0])
    conn = Connection(
        url,
        ssl=True,
        connect_timeout=2,
        transport_options={"global_keyprefix": prefix, "socket_timeout": 2},
    )
    got: list[Any] = []
    try:
        consumer = Consumer(
            conn.channel(),
            [Queue(exchange=exchange, exclusive=True, auto_delete=True), direct],
            callbacks=[lambda body, m: (got.append(body), m.ack())],
            accept=["json"],
        )
        consumer.consume()
        try:
            conn.drain_events(timeout=0.3)  # subscribes to the fanout
        except TimeoutError:
            pass
        producer = Producer(conn.channel())
        producer.publish({"to": "all"}, exchange=exchange, declare=[exchange])
        producer.publish(
            {"to": "one"},
            exchange=direct.exchange,
            routing_key=direct.routing_key,
            declare=[direct],
        )
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
        consumer.cancel()
    finally:
        conn.release()
    assert sorted(got, key=str) == [{"to": "all"}, {"to": "one"}]
