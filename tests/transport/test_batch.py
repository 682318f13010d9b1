"""kombu's ``Producer.batch()`` on ``emq://``: publishes sent together, each job as stored alone."""

from __future__ import annotations

import functools
import pickle
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


def task_headers(task_id: str) -> dict[str, Any]:
    """The headers a Celery task message carries (protocol 2): its name and id."""
    return {"task": "tests.noop", "id": task_id}


def test_a_failed_fanout_flush_raises_batch_publish_error_naming_the_message(
    connect: ConnFactory, server: RedisServer
) -> None:
    # Not the raw redis error: kombu's retry (apply_async's retry=True) would
    # take that for a lost connection and publish into the failed batch again.
    conn = connect(emq_url(server), socket_timeout=1)
    exchange = Exchange("bcast", "fanout", durable=False)
    producer = Producer(conn.channel())
    with pytest.raises(BatchPublishError) as err, producer.batch():
        producer.publish({"ping": 1}, exchange=exchange, declare=[exchange])
        server.stop()
    failed = err.value
    assert isinstance(failed, BatchFlushError)
    assert isinstance(failed.__cause__, redis.ConnectionError)
    assert [(m.job_id, m.task_id, m.outcome) for m in failed.messages] == [(None, None, "unknown")]


def test_a_fanout_publish_retried_by_kombu_is_not_retried_into_a_failed_batch(
    connect: ConnFactory, server: RedisServer
) -> None:
    conn = connect(emq_url(server), socket_timeout=1)
    exchange = Exchange("bcast", "fanout", durable=False)
    producer = Producer(conn.channel())
    producer.publish({"warm": 1}, exchange=exchange, declare=[exchange])
    server.stop()
    with pytest.raises(BatchPublishError) as err, producer.batch(max_size=1):
        producer.publish(
            {"ping": 1},
            exchange=exchange,
            retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0},
        )
    # The first attempt's error, naming its message: kombu did not publish again.
    assert isinstance(err.value, BatchFlushError)
    assert [(m.job_id, m.outcome) for m in err.value.messages] == [(None, "unknown")]


def test_a_failed_flush_names_each_message_by_task_id_and_the_fanout_not_sent(
    connect: ConnFactory, server: RedisServer
) -> None:
    conn = connect(emq_url(server), socket_timeout=1)
    q = queue()
    exchange = Exchange("bcast", "fanout", durable=False)
    producer = producer_on(conn, q)
    with pytest.raises(BatchPublishError) as err, producer.batch():
        for i in range(3):
            producer.publish(
                {"i": i}, exchange=q.exchange, routing_key="q", headers=task_headers(f"t{i}")
            )
        producer.publish({"reply": 1}, exchange=q.exchange, routing_key="q")
        producer.publish({"ping": 1}, exchange=exchange, declare=[exchange])
        server.stop()
    failed = err.value
    assert isinstance(failed, BatchFlushError)
    got = [(m.queue, m.task_id, m.outcome) for m in failed.messages]
    assert got[:4] == [
        ("q", "t0", "unknown"),
        ("q", "t1", "unknown"),
        ("q", "t2", "unknown"),
        ("q", None, "unknown"),
    ]
    # The store's call failed: the broadcast was never sent, and the error says so.
    assert [(m.job_id, m.outcome) for m in failed.messages[4:]] == [(None, "not stored")]
    assert [m.job_id for m in failed.messages[:4]] == [j for _, j in failed.unknown]
    assert failed.task_ids("unknown") == ["t0", "t1", "t2"]
    assert "t0" in str(failed)


def test_a_flush_failing_before_a_publish_names_that_publish_not_stored(
    connect: ConnFactory, server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = connect(emq_url(server), socket_timeout=1)
    x = Exchange("x", "direct")
    producer = producer_on(
        conn, Queue("q1", x, routing_key="one"), Queue("q1", x, routing_key="both")
    )
    Queue("q2", x, routing_key="both")(producer.channel).declare()
    channel = producer.channel
    # Routing reads kombu's bindings from Redis: read them once, before the server stops.
    monkeypatch.setattr(channel, "_lookup", functools.lru_cache(channel._lookup))
    assert sorted(channel._lookup("x", "both")) == ["q1", "q2"]
    assert sorted(channel._lookup("x", "one")) == ["q1"]
    with pytest.raises(BatchPublishError) as err, producer.batch(max_size=2):
        producer.publish({"i": 0}, exchange=x, routing_key="one", headers=task_headers("a"))
        server.stop()
        # Two jobs: the flush at max_size comes before they are buffered, and fails.
        producer.publish({"i": 1}, exchange=x, routing_key="both", headers=task_headers("b"))
    failed = err.value
    assert isinstance(failed, BatchFlushError)
    got = [(m.queue, m.task_id, m.outcome) for m in failed.messages]
    # kombu routes to a message's queues in no fixed order.
    assert got[:1] + sorted(got[1:]) == [
        ("q1", "a", "unknown"),
        ("q1", "b", "not stored"),
        ("q2", "b", "not stored"),
    ]
    assert failed.task_ids("unknown", "not stored") == ["a", "b", "b"]


def test_a_flush_whose_every_job_is_a_duplicate_registers_its_queue(
    connect: ConnFactory, store: JobStore
) -> None:
    # A replayed pipeline (or a caller publishing the unknown jobs again) finds
    # every job already there: its queue must still be recorded, as a single
    # publish's DUPLICATE records it.
    q = queue()
    first = producer_on(connect(), q)
    with first.batch():
        first.publish(
            {}, exchange=q.exchange, routing_key="q", emq_job_id="j1", headers=task_headers("t1")
        )
    assert store.queues() == ["q"]
    store.client.srem(store.registry_key, "q")
    again = producer_on(connect(), q)
    with again.batch():
        again.publish(
            {}, exchange=q.exchange, routing_key="q", emq_job_id="j1", headers=task_headers("t1")
        )
    assert store.size("q") == 1
    assert store.queues() == ["q"]


def test_a_batch_flush_error_pickles_with_its_messages() -> None:
    from celery_emq.transport.errors import BatchFlushError as Raised

    failed = Raised(
        "ConnectionError: lost",
        [],
        [],
        [("q", "j1")],
        messages=[("q", "j1", "t1", "unknown"), ("/0.bcast", None, None, "not stored")],
    )
    again = pickle.loads(pickle.dumps(failed))
    assert isinstance(again, BatchPublishError)
    assert again.messages == failed.messages
    assert again.messages[0].task_id == "t1"
    assert again.task_ids("unknown") == ["t1"]
    assert str(again) == str(failed)
    assert "task(s) not known stored: t1" in str(again)
