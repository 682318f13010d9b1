"""The transport on a Redis Cluster, driven through kombu's Connection/Producer/Consumer."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from redis.cluster import RedisCluster, key_slot

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.store.jobstore import JobStore
from celery_emq.store.status import queue_status
from celery_emq.transport.cluster import ClusterChannel
from tests.faults.servers import RedisServer

from .cluster_servers import Cluster

ConnFactory = Callable[..., Connection]


@pytest.fixture
def connect(redis_cluster: Cluster, cluster_prefix: str) -> Iterator[ConnFactory]:
    opened: list[Connection] = []

    def factory(**topts: Any) -> Connection:
        conn = Connection(
            redis_cluster.url, transport_options={"global_keyprefix": cluster_prefix, **topts}
        )
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        conn.release()


def queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def spread_names(n: int) -> list[str]:
    """``n`` queue names whose keys live in ``n`` different slots."""
    names: list[str] = []
    slots: set[int] = set()
    i = 0
    while len(names) < n:
        name = f"q{i}"
        s = key_slot(name.encode())
        if s not in slots:
            slots.add(s)
            names.append(name)
        i += 1
    return names


def drain(conn: Connection, got: list[Any], n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass


def consume(conn: Connection, queues: list[Queue], n: int) -> list[int]:
    """Ack up to ``n`` messages from ``queues``; return the ``i`` of each body."""
    got: list[int] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body["i"])
        message.ack()

    with Consumer(conn.channel(), queues, callbacks=[on_message], accept=["json"]):
        drain(conn, got, n)
    return got


def test_a_cluster_url_runs_the_store_on_redis_cluster(connect: ConnFactory) -> None:
    channel = connect().channel()
    assert isinstance(channel, ClusterChannel)
    assert isinstance(channel.store.client, RedisCluster)


def test_queues_in_several_slots_are_consumed_and_acked(
    connect: ConnFactory, cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    names = spread_names(5)
    queues = [queue(n) for n in names]
    producer = Producer(connect().channel())
    for i in range(20):
        q = queues[i % 5]
        producer.publish({"i": i}, exchange=q.exchange, routing_key=q.routing_key, declare=[q])
    assert sorted(consume(connect(), queues, 20)) == list(range(20))
    store = JobStore(cluster_client, cluster_prefix + "emq", 30_000)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        store.counts(n)["active"] for n in names
    ):  # acks may be batched
        time.sleep(0.05)
    assert [store.counts(n) for n in names] == [
        {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    ] * 5
    assert sum(store.metrics(n)["completed"] for n in names) == 20


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu before 5.7")
def test_a_publish_batch_stores_each_queue_on_the_master_of_its_slot(
    connect: ConnFactory, cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    names = spread_names(4)
    queues = [queue(n) for n in names]
    producer = Producer(connect().channel())
    for q in queues:
        q(producer.channel).declare()
    store = JobStore(cluster_client, cluster_prefix + "emq", 30_000)
    with producer.batch(max_size=30):
        for i in range(40):
            q = queues[i % 4]
            producer.publish({"i": i}, exchange=q.exchange, routing_key=q.routing_key)
        # One flush at 30, spread over the four queues' slots.
        assert sum(store.size(n) for n in names) == 30
    assert [store.size(n) for n in names] == [10] * 4
    assert sorted(consume(connect(), queues, 40)) == list(range(40))


#: Commands of the cluster itself (replicas acknowledge their offset every second)
#: and of the measuring clients.
_OWN = ("cmdstat_replconf", "cmdstat_info", "cmdstat_config|resetstat", "cmdstat_hello")


def _reset(cluster: Cluster) -> None:
    for node in cluster.nodes:
        node.client().config_resetstat()


def _commands(cluster: Cluster) -> dict[str, int]:
    """The commands the masters ran since :func:`_reset` (their scripts' calls included)."""
    calls: dict[str, int] = {}
    for node in cluster.nodes:
        if cluster.role(node) != "master":
            continue  # a replica runs what its master's scripts wrote
        for name, stat in node.client().info("commandstats").items():
            if name not in _OWN:
                command = name[len("cmdstat_") :]
                calls[command] = calls.get(command, 0) + int(stat["calls"])
    return calls


def _single_server_idle(queues: list[Queue], workdir: Path, idle_s: float) -> dict[str, int]:
    """The commands a private single server runs for the same idle consumer."""
    server = RedisServer(workdir)
    server.start()
    try:
        conn = Connection(server.url.replace("redis://", "emq://", 1))
        with Consumer(conn.channel(), queues, callbacks=[], accept=["json"]):
            drain(conn, [], 1, timeout=6)
            client = server.client()
            client.config_resetstat()
            drain(conn, [], 1, timeout=idle_s)
            calls = {
                name[len("cmdstat_") :]: int(stat["calls"])
                for name, stat in client.info("commandstats").items()
                if name not in _OWN
            }
        conn.release()
        return calls
    finally:
        server.stop()


def test_an_idle_consumer_wakes_in_milliseconds_and_costs_little(
    connect: ConnFactory, redis_cluster: Cluster, tmp_path: Path
) -> None:
    names = spread_names(3)
    queues = [queue(n) for n in names]
    producer = Producer(connect().channel())
    for q in queues:
        q(producer.channel).declare()
    conn = connect()
    latencies: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        latencies.append((time.time() - body["t"]) * 1000)
        message.ack()

    with Consumer(conn.channel(), queues, callbacks=[on_message], accept=["json"]):
        # The consumer settles into its wait, and sweeps once (loading scripts).
        drain(conn, latencies, 1, timeout=6)
        # Idle: the consumer waits on three slots; count every command the cluster runs.
        idle_s = 5.0
        _reset(redis_cluster)
        drain(conn, latencies, 1, timeout=idle_s)
        idle = _commands(redis_cluster)
        idle_per_s = sum(idle.values()) / idle_s

        def publish() -> None:
            for i in range(30):
                time.sleep(0.1)  # the consumer is idle again before each publish
                q = queues[i % 3]
                producer.publish({"t": time.time()}, exchange=q.exchange, routing_key=q.routing_key)

        thread = threading.Thread(target=publish)
        thread.start()
        drain(conn, latencies, 30, timeout=15)
        thread.join()
    single = _single_server_idle(queues, tmp_path / "single", idle_s)
    single_per_s = sum(single.values()) / idle_s
    p50 = statistics.median(latencies)
    print(
        json.dumps(
            {
                "cluster_wake_p50_ms": round(p50, 2),
                "cluster_wake_max_ms": round(max(latencies), 2),
                "idle_commands_per_s": round(idle_per_s, 2),
                "idle_brpop_per_s": idle.get("brpop", 0) / idle_s,
                "idle_evalsha_per_s": idle.get("evalsha", 0) / idle_s,
                "idle_commands": idle,
                "single_server_idle_commands_per_s": round(single_per_s, 2),
                "single_server_idle_commands": single,
                "queues": 3,
            }
        )
    )
    assert len(latencies) == 30
    assert p50 < 20
    # A blocking wait per slot a second where a single server has one wait for
    # the three; the scan and the sweeps are the same on both. (Their rate is
    # the process's: an earlier test in the process may have set a shorter
    # sweep interval, so the cost is judged against the single server's,
    # measured here in the same process.)
    assert idle.get("brpop", 0) / idle_s <= 3 + 0.5
    assert idle_per_s <= single_per_s * 1.15 + 2 + 1


def test_fanout_and_an_expiring_reply_queue_work(connect: ConnFactory) -> None:
    # Celery's remote control: a fanout exchange (PUBLISH/SUBSCRIBE) and a
    # reply queue declared with x-expires (kombu 5.7 keeps binding deadlines).
    exchange = Exchange("bcast", "fanout", durable=False)
    conns = [connect(), connect()]
    got: list[list[Any]] = [[], []]
    consumers = []
    for conn, into in zip(conns, got, strict=True):
        q = Queue(exchange=exchange, exclusive=True, auto_delete=True)
        consumers.append(
            Consumer(
                conn.channel(),
                [q],
                callbacks=[lambda body, m, into=into: into.append(body)],
                accept=["json"],
                no_ack=True,
            )
        )
    reply = Queue("reply.x", Exchange("reply", "direct"), routing_key="reply.x", expires=10.0)
    for c in consumers:
        c.consume()
    producer = Producer(connect().channel())
    for conn in conns:  # each consumer subscribes on its first wait
        drain(conn, [], 1, timeout=0.3)
    producer.publish({"ping": 1}, exchange=exchange, declare=[exchange])
    producer.publish({"pong": 1}, exchange=reply.exchange, routing_key="reply.x", declare=[reply])
    for conn, into in zip(conns, got, strict=True):
        drain(conn, into, 1, timeout=5)
    assert got == [[{"ping": 1}], [{"ping": 1}]]
    replies: list[Any] = []
    conn = connect()
    with Consumer(conn.channel(), [reply], callbacks=[lambda b, m: (replies.append(b), m.ack())]):
        drain(conn, replies, 1, timeout=5)
    assert replies == [{"pong": 1}]
    for c in consumers:
        c.cancel()


def test_a_gone_reply_queue_leaves_no_binding_and_no_key(
    connect: ConnFactory, cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    reply = Queue("reply.gone", Exchange("replies", "direct"), routing_key="r", expires=0.2)
    kept = Queue("reply.kept", Exchange("replies", "direct"), routing_key="k", expires=60)
    conn = connect()
    channel = conn.channel()
    producer = Producer(channel)
    got: list[Any] = []
    with Consumer(channel, [reply, kept], callbacks=[lambda b, m: got.append(b)], no_ack=True):
        producer.publish({"pong": 1}, exchange=reply.exchange, routing_key="r", declare=[reply])
        drain(conn, got, 1, timeout=5)
    assert got == [{"pong": 1}]
    table = cluster_prefix + "_kombu.binding.replies"
    assert len(cluster_client.smembers(table)) == 2
    time.sleep(0.4)
    channel.store.expire()
    # The gone queue's binding and keys go; the queue still in use keeps its own.
    assert [m.decode().rsplit(channel.sep, 1)[1] for m in cluster_client.smembers(table)] == [
        "reply.kept"
    ]
    assert not [
        k
        for node in cluster_client.get_primaries()
        for k in cluster_client.get_redis_connection(node).scan_iter(
            match=cluster_prefix + "emq:{reply.gone}*"
        )
    ]


def test_queue_status_reads_a_queue_on_the_cluster(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    store = JobStore(cluster_client, cluster_prefix + "emq", 30_000)
    for i in range(3):
        store.enqueue("tasks", str(i), "{}", group="g" if i else "")
    store.claim("tasks", "me", 1)
    status = queue_status(store, "tasks")
    assert (status["pending"], status["active"], sum(status["lanes"].values())) == (2, 1, 1)
    assert status["oldest_lease_age_ms"] is not None


def test_flower_reads_queue_lengths_on_the_cluster(
    redis_cluster: Cluster, cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    pytest.importorskip("flower")
    import asyncio

    from flower.utils.broker import Broker

    from celery_emq.ops.flower import register

    assert register()
    store = JobStore(cluster_client, cluster_prefix + "emq", 30_000)
    names = spread_names(4)
    for i, name in enumerate(names):
        for j in range(i + 1):
            store.enqueue(name, str(j), "{}", group="g" if j % 2 else "")
    store.claim(names[3], "me", 1)
    url = f"emq+cluster://127.0.0.1:{redis_cluster.ports[0]}"
    broker = Broker(url, broker_options={"global_keyprefix": cluster_prefix})
    lengths = asyncio.run(broker.queues(names))
    assert [(q["name"], q["messages_ready"], q["messages_unacknowledged"]) for q in lengths] == [
        (names[0], 1, 0),
        (names[1], 2, 0),
        (names[2], 3, 0),
        (names[3], 3, 1),
    ]


def test_the_server_check_reads_every_master(cluster_client: RedisCluster) -> None:
    from celery_emq.store.server import check_server

    check = check_server(cluster_client)
    # The test cluster keeps nothing on disk (--save '' --appendonly no).
    assert check.persistence == "none"
    assert check.maxmemory_policy == "noeviction"
    assert len(check.notes) == 1


def _waits(cluster: Cluster) -> dict[int, int]:
    """``WAIT`` calls per node since :func:`_reset`."""
    return {
        node.port: int(node.client().info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
        for node in cluster.nodes
    }


def test_wait_replicas_waits_on_the_master_of_each_queue(
    redis_cluster: Cluster, cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    from functools import partial

    from celery_emq.errors import ReplicasUnconfirmedError
    from celery_emq.store.loader import SCRIPT_NAMES, script_source
    from celery_emq.store.outcomes import Outcome

    prefix = cluster_prefix + "emq"
    store = JobStore(cluster_client, prefix, 30_000, wait_replicas=1, wait_timeout_ms=2000)
    names = spread_names(6)
    masters = [redis_cluster.master_of(store.keys(n).pending).port for n in names]
    assert len(set(masters)) > 1
    # A master's first call of a script loads it: a round trip (and a WAIT) more.
    for name in SCRIPT_NAMES:
        cluster_client.script_load(script_source(name))
    _reset(redis_cluster)
    assert [store.enqueue(n, "1", "{}") for n in names] == [Outcome.OK] * 6
    expected = {port: masters.count(port) for port in masters}
    assert {p: n for p, n in _waits(redis_cluster).items() if n} == expected

    # One settle batch over queues of several masters: a WAIT on each.
    claims = {n: store.claim(n, "me", 1)[0] for n in names}
    _reset(redis_cluster)
    batch = store.scripts.batch()
    for n, c in claims.items():
        batch.ack(store.keys(n), [(c.id, c.token)])
    batch.execute(confirm=partial(store.confirm_replicas))
    assert batch.confirmed == 1
    assert {p: n for p, n in _waits(redis_cluster).items() if n} == {p: 1 for p in set(masters)}

    # Each master has one replica: two cannot confirm.
    strict = JobStore(cluster_client, prefix, 30_000, wait_replicas=2, wait_timeout_ms=100)
    with pytest.raises(ReplicasUnconfirmedError):
        strict.enqueue(names[0], "2", "{}")
