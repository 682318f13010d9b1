"""kombu's ``Producer.batch()`` on ``emq://``: publishes sent together, each job as stored alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.errors import BatchFlushError
from celery_emq.store.jobstore import JobStore
from celery_emq.store.loader import script_source
from celery_emq.store.outcomes import Outcome
from tests.conftest import CLUSTER
from tests.faults.servers import RedisServer
from tests.transport.conftest import ConnFactory

BatchPublishError = pytest.importorskip("kombu.exceptions").__dict__.get("BatchPublishError")
pytestmark = pytest.mark.skipif(
    BatchPublishError is None or not hasattr(Producer, "batch"),
    reason="kombu before 5.7 has no Producer.batch()",
)


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", lease_ms=30_000)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private ``redis-server`` (its command statistics are the test's own)."""
    if CLUSTER:
        pytest.skip("a private single server")
    started = RedisServer(tmp_path)
    started.start()
    yield started
    started.stop()


def producer_on(conn: Connection, *queues: Queue) -> Producer:
    """A producer on ``conn`` with ``queues`` declared."""
    producer = Producer(conn.channel())
    for q in queues:
        q(producer.channel).declare()
    return producer


def emq_url(server: RedisServer) -> str:
    return server.url.replace("redis://", "emq://", 1)


def queue(name: str = "q", **kw: Any) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name, **kw)


def drain(conn: Connection, queues: list[Queue], n: int, timeout: float = 5) -> list[Any]:
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Consumer(conn.channel(), queues, callbacks=[on_message], accept=["json"]):
        for _ in range(int(timeout / 0.25)):
            if len(got) >= n:
                break
            try:
                conn.drain_events(timeout=0.25)
            except TimeoutError:
                pass
    return got


def commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT (scripts' own calls included)."""
    return {
        name[len("cmdstat_") :]: int(stat["calls"])
        for name, stat in client.info("commandstats").items()
    }


def test_batches_stay_on_under_a_retrying_client(connect: ConnFactory, redis_url: str) -> None:
    # kombu's stock transport turns them off here (a replayed pipeline would
    # store its messages twice); a replayed flush stores no job twice here.
    assert Producer(connect().channel()).supports_batch_publish
    retrying = Producer(connect(retry_on_timeout=True).channel())
    assert retrying.supports_batch_publish
    stock = Connection(redis_url, transport_options={"retry_on_timeout": True})
    try:
        assert not Producer(stock.channel()).supports_batch_publish
    finally:
        stock.release()


def test_a_batch_stores_every_job_at_its_end_and_not_before(
    connect: ConnFactory, store: JobStore
) -> None:
    q = queue()
    producer = Producer(connect().channel())
    producer.declare()
    q(producer.channel).declare()
    with producer.batch():
        for i in range(10):
            producer.publish({"i": i}, exchange=q.exchange, routing_key="q")
        assert store.size("q") == 0
    assert store.size("q") == 10
    got = drain(connect(), [q], 10)
    assert got == [{"i": i} for i in range(10)]


def test_a_batch_flushes_at_max_size(connect: ConnFactory, store: JobStore) -> None:
    q = queue()
    producer = Producer(connect().channel())
    q(producer.channel).declare()
    sizes = []
    with producer.batch(max_size=3):
        for i in range(7):
            producer.publish({"i": i}, exchange=q.exchange, routing_key="q")
            sizes.append(store.size("q"))
    assert sizes == [0, 0, 3, 3, 3, 6, 6]
    assert store.size("q") == 7


def test_a_batch_that_raises_stores_only_what_was_flushed(
    connect: ConnFactory, store: JobStore
) -> None:
    q = queue()
    producer = Producer(connect().channel())
    q(producer.channel).declare()
    with pytest.raises(ZeroDivisionError), producer.batch(max_size=4):
        for i in range(6):
            producer.publish({"i": i}, exchange=q.exchange, routing_key="q")
        raise ZeroDivisionError
    assert store.size("q") == 4


def test_priorities_groups_and_delays_in_a_batch(
    connect: ConnFactory, store: JobStore, client: redis.Redis
) -> None:
    q = queue(max_priority=9)
    producer = Producer(connect().channel())
    q(producer.channel).declare()
    eta = "2999-01-01T00:00:00+00:00"
    with producer.batch():
        producer.publish({"n": "nine"}, exchange=q.exchange, routing_key="q", priority=9)
        producer.publish({"n": "one"}, exchange=q.exchange, routing_key="q", priority=1)
        for tenant in ("a", "b", "a"):
            producer.publish(
                {"n": tenant}, exchange=q.exchange, routing_key="q", headers={"emq_group": tenant}
            )
        producer.publish(
            {"n": "later"},
            exchange=q.exchange,
            routing_key="q",
            headers={"task": "t", "id": "task-later", "eta": eta},
        )
    counts = store.counts("q")
    assert counts["delayed"] == 1
    assert store.lanes("q") == {"a": 2, "b": 1}
    k = store.keys("q")
    assert client.hget(k.etas, "task-later") is not None
    # Claims rotate over the default lane and each group's; in a lane the
    # lower priority number goes first (as kombu's Redis transport orders them).
    got = [body["n"] for body in drain(connect(), [q], 5)]
    assert got == ["a", "b", "one", "a", "nine"]


def test_fanout_in_a_batch_reaches_every_subscriber(connect: ConnFactory) -> None:
    exchange = Exchange("bcast", "fanout", durable=False)
    conns = [connect(), connect()]
    got: list[list[Any]] = [[], []]
    consumers = []
    for conn, into in zip(conns, got, strict=True):
        fq = Queue(exchange=exchange, exclusive=True, auto_delete=True)
        consumers.append(
            Consumer(
                conn.channel(),
                [fq],
                callbacks=[lambda body, m, into=into: into.append(body)],
                accept=["json"],
                no_ack=True,
            )
        )
        consumers[-1].consume()
    for conn in conns:  # each consumer subscribes on its first wait
        try:
            conn.drain_events(timeout=0.3)
        except TimeoutError:
            pass
    producer = Producer(connect().channel())
    with producer.batch():
        producer.publish({"ping": 1}, exchange=exchange, declare=[exchange])
        producer.publish({"ping": 2}, exchange=exchange)
    for conn, into in zip(conns, got, strict=True):
        for _ in range(20):
            if len(into) >= 2:
                break
            try:
                conn.drain_events(timeout=0.25)
            except TimeoutError:
                pass
    assert got == [[{"ping": 1}, {"ping": 2}]] * 2
    for c in consumers:
        c.cancel()


def test_one_script_call_per_queue_and_one_wake_push_per_flush(
    connect: ConnFactory, server: RedisServer
) -> None:
    conn = connect(emq_url(server))
    qs = [queue("q1"), queue("q2")]
    producer = producer_on(conn, *qs)
    client = server.client()
    with producer.batch():  # loads the scripts
        producer.publish({}, exchange=qs[0].exchange, routing_key="q1")
    client.config_resetstat()
    with producer.batch(max_size=100):
        for i in range(60):
            q = qs[i % 2]
            producer.publish({"i": i}, exchange=q.exchange, routing_key=q.name)
    calls = commands(client)
    assert calls.get("evalsha", 0) + calls.get("eval", 0) == 2
    assert calls["lpush"] == 2
    # Per queue: one MSET of its messages, one ZADD into its queue, one SET of its sequence.
    assert calls["mset"] == 2
    assert calls["zadd"] == 2
    assert calls["set"] == 2
    assert calls["hset"] == 60  # a row each
    assert client.llen(conn.default_channel.store.keys("q1").wake) == 31


def test_wait_replicas_waits_once_per_flush(connect: ConnFactory, server: RedisServer) -> None:
    conn = connect(emq_url(server), wait_replicas=1, wait_timeout_ms=50)
    q = queue()
    producer = producer_on(conn, q)
    client = server.client()
    client.script_load(script_source("enqueue_many"))
    client.config_resetstat()
    with pytest.raises(BatchPublishError) as err, producer.batch(max_size=5):
        for i in range(5):
            producer.publish({"i": i}, exchange=q.exchange, routing_key="q")
    assert commands(client)["wait"] == 1
    failed = err.value
    assert isinstance(failed, BatchFlushError)
    # No replica: the jobs stand on the master, and the error says so.
    assert failed.confirmed == 0
    assert len(failed.stored) == 5
    assert failed.unknown == []
    assert conn.default_channel.store.size("q") == 5


def test_a_flush_to_a_stopped_server_raises_batch_publish_error(
    connect: ConnFactory, server: RedisServer
) -> None:
    conn = connect(emq_url(server), socket_timeout=1)
    q = queue()
    producer = producer_on(conn, q)
    with pytest.raises(BatchPublishError) as err, producer.batch(max_size=4):
        for i in range(6):
            producer.publish({"i": i}, exchange=q.exchange, routing_key="q")
        server.stop()
    failed = err.value
    assert isinstance(failed, BatchFlushError)
    assert failed.stored == []
    # The first flush (4 jobs) went through; the last 2 are of unknown outcome.
    assert len(failed.unknown) == 2


def test_a_flush_sent_again_stores_no_job_twice(connect: ConnFactory, store: JobStore) -> None:
    q = queue()
    producer = Producer(connect().channel())
    q(producer.channel).declare()
    channel = producer.channel
    batch = channel.create_publish_batch(max_size=100)
    messages = [
        channel.prepare_message(f'{{"i": {i}}}', 0, "application/json", "utf-8", {}, {})
        for i in range(5)
    ]
    for message in messages:
        batch.publish(message, exchange="q", routing_key="q")
    # What the flush sends, sent twice: as a retried pipeline would.
    jobs = dict(batch._jobs)
    batch.flush()
    for name, js in jobs.items():
        assert store.enqueue_many(name, js) == [Outcome.DUPLICATE] * 5
    batch.close()
    assert store.size("q") == 5
