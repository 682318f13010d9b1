"""emq+sentinel://: every connection of the transport follows the master Sentinel names."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.exceptions import OperationalError

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.errors import InvalidOptionError
from celery_emq.transport.sentinel import MASTER_CHECK_S

from .sentinel_servers import SentinelTopology


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


def connect(topo: SentinelTopology, prefix: str, **topts: Any) -> Connection:
    return Connection(
        topo.broker_url(db=3),
        transport_options={"master_name": topo.master_name, "global_keyprefix": prefix, **topts},
    )


def queue(name: str = "q") -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def drain(conn: Connection, q: Queue, n: int, timeout: float = 10) -> list[Any]:
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Consumer(conn, [q], callbacks=[on_message], accept=["json"]):
        for _ in range(50):
            if len(got) >= n:
                break
            try:
                conn.drain_events(timeout=timeout / 50)
            except TimeoutError:
                pass
    return got


@pytest.fixture
def conn(sentinel_topology: SentinelTopology, prefix: str) -> Iterator[Connection]:
    c = connect(sentinel_topology, prefix)
    yield c
    c.release()


def test_missing_master_name_is_an_error_naming_the_option(
    sentinel_topology: SentinelTopology,
) -> None:
    c = Connection(sentinel_topology.broker_url())
    try:
        with pytest.raises(InvalidOptionError) as err:
            c.connect()
        assert "master_name" in str(err.value)
    finally:
        c.release()


def test_publish_and_consume_through_the_master_sentinel_names(
    sentinel_topology: SentinelTopology, conn: Connection, prefix: str
) -> None:
    q = queue()
    Producer(conn).publish({"n": 1}, exchange=q.exchange, routing_key="q", declare=[q])
    master = redis.Redis.from_url(sentinel_topology.master_url(3))
    try:
        # The job is on the master, in the URL's database, under the prefix.
        assert master.zcard(f"{prefix}emq:{{q}}:pending") == 1
    finally:
        master.close()
    assert drain(conn, q, 1) == [{"n": 1}]
    # The store's own client (lease keeper, settles, sweep, CLI) is on the master too.
    store_client = conn.default_channel.store.client
    port = store_client.connection_pool.get_master_address()[1]
    assert port == sentinel_topology.master.port


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu before 5.7")
def test_a_publish_batch_goes_to_the_master_sentinel_names(
    sentinel_topology: SentinelTopology, conn: Connection, prefix: str
) -> None:
    q = queue()
    producer = Producer(conn)
    q(producer.channel).declare()
    master = redis.Redis.from_url(sentinel_topology.master_url(3))
    try:
        with producer.batch(max_size=4):
            for i in range(6):
                producer.publish({"n": i}, exchange=q.exchange, routing_key="q")
            assert master.zcard(f"{prefix}emq:{{q}}:pending") == 4
        assert master.zcard(f"{prefix}emq:{{q}}:pending") == 6
    finally:
        master.close()
    assert drain(conn, q, 6) == [{"n": i} for i in range(6)]


def test_fanout_goes_through_pub_sub_on_the_master(conn: Connection) -> None:
    # Remote control and events travel this way (PUBLISH / SUBSCRIBE).
    exchange = Exchange("bcast", "fanout")
    q = Queue("", exchange, exclusive=True, auto_delete=True)
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Consumer(conn, [q], callbacks=[on_message], accept=["json"]):
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            Producer(conn).publish({"hello": 1}, exchange=exchange, serializer="json")
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
    assert got[:1] == [{"hello": 1}]


def test_sentinel_options_keep_their_meaning(
    sentinel_topology: SentinelTopology, prefix: str
) -> None:
    # Three sentinels: each has two others, never five.
    c = connect(sentinel_topology, prefix, min_other_sentinels=5)
    try:
        with pytest.raises(OperationalError, match="No master found"):
            c.default_channel.client.ping()
    finally:
        c.release()
    c = connect(
        sentinel_topology, prefix, min_other_sentinels=2, sentinel_kwargs={"socket_timeout": 2}
    )
    try:
        assert c.default_channel.client.ping()
    finally:
        c.release()


def test_flower_reads_queue_lengths_through_sentinel(
    sentinel_topology: SentinelTopology, conn: Connection, prefix: str
) -> None:
    pytest.importorskip("flower")
    from celery import Celery
    from celery._state import get_current_app
    from flower.utils.broker import Broker

    from celery_emq.ops.flower import register

    q = queue("fq")
    producer = Producer(conn)
    for i in range(3):
        producer.publish({"n": i}, exchange=q.exchange, routing_key="fq", declare=[q])
    assert register()
    options = {"master_name": sentinel_topology.master_name, "global_keyprefix": prefix}
    url = sentinel_topology.broker_url(db=3)
    [info] = asyncio.run(Broker(url, broker_options=options).queues(["fq"]))
    assert (info["name"], info["messages_ready"], info["messages"]) == ("fq", 3, 3)
    # What Flower hands is the app's URL as kombu writes it: the first sentinel,
    # without the database. The app's own URL completes it.
    app = Celery("flowered", set_as_current=False)
    app.conf.update(broker_url=url, broker_transport_options=options)
    with app.connection_for_read() as c:
        first = c.as_uri(include_password=True)
    assert ";" not in first and first.startswith("emq+sentinel://")
    previous = get_current_app()
    app.set_current()
    try:
        [info] = asyncio.run(Broker(first, broker_options=options).queues(["fq"]))
    finally:
        previous.set_current()
        app.close()
    assert info["messages_ready"] == 3


def test_every_connection_follows_the_master_through_a_failover(
    own_sentinel_topology: SentinelTopology, prefix: str
) -> None:
    topo = own_sentinel_topology
    conn = connect(topo, prefix)
    try:
        q = queue()
        producer = Producer(conn)
        producer.publish({"n": 1}, exchange=q.exchange, routing_key="q", declare=[q])
        assert drain(conn, q, 1) == [{"n": 1}]
        channel = conn.default_channel
        old = topo.kill_master()
        new = topo.wait_promoted(old)
        # kombu's client, after its connection to the old master broke, and
        # the store's client reconnect to the promoted replica. Right after the
        # switch a sentinel may not vouch for the new master yet: retry as a
        # worker's connection does, a bounded number of times.
        got: list[Any] = []
        errors: list[str] = []
        for _ in range(20):
            try:
                conn.ensure_connection(max_retries=5)
                Producer(conn).publish({"n": 2}, exchange=q.exchange, routing_key="q", declare=[q])
                break
            except conn.recoverable_connection_errors as exc:
                errors.append(repr(exc))
                time.sleep(0.25)
        for _ in range(20):
            try:
                got = drain(conn, q, 1)
                break
            except conn.recoverable_connection_errors as exc:
                errors.append(repr(exc))
                conn.ensure_connection(max_retries=5)
                time.sleep(0.25)
        assert got == [{"n": 2}], errors
        store = conn.default_channel.store
        assert store.client.connection_pool.get_master_address() == new
        assert store.size("q") == 0
        assert channel.store.client.connection_pool.get_master_address() == new
        promoted = redis.Redis(host=new[0], port=new[1], db=3)
        try:
            assert promoted.info("replication")["role"] == "master"
        finally:
            promoted.close()
    finally:
        conn.release()


def _name_another_master(topo: SentinelTopology) -> tuple[str, int]:
    """Make the sentinels name the replica the master while the old master stays writable.

    The replica becomes a master of its own and every sentinel monitors it in
    place of the old one, which keeps running and taking writes: what the
    clients of a failed-over deployment meet when the old master is not
    demoted at once (a second failover, or a partition that heals late).
    """
    new = ("127.0.0.1", topo.replica.port)
    topo.replica.client().execute_command("REPLICAOF", "NO", "ONE")
    for s in topo.sentinels:
        c = s.client()
        try:
            c.execute_command("SENTINEL", "REMOVE", topo.master_name)
            c.execute_command("SENTINEL", "MONITOR", topo.master_name, new[0], new[1], 2)
        finally:
            c.close()
    assert topo.master_address() == new
    return new


def test_connections_leave_a_master_the_sentinels_no_longer_name(
    own_sentinel_topology: SentinelTopology, prefix: str
) -> None:
    topo = own_sentinel_topology
    conn = connect(topo, prefix)
    old = redis.Redis(host="127.0.0.1", port=topo.master.port, db=3)
    try:
        q = queue()
        Producer(conn).publish({"n": 1}, exchange=q.exchange, routing_key="q", declare=[q])
        assert drain(conn, q, 1) == [{"n": 1}]
        channel = conn.default_channel
        new = _name_another_master(topo)
        promoted = redis.Redis(host=new[0], port=new[1], db=3)
        # No connection broke: each pool must find out by asking the sentinels again.
        store_pool = channel.store.client.connection_pool
        deadline = time.monotonic() + 10 * MASTER_CHECK_S
        while store_pool.master_address != new and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store_pool.master_address == new
        Producer(conn).publish({"n": 2}, exchange=q.exchange, routing_key="q", declare=[q])
        pending = f"{prefix}emq:{{q}}:pending"
        assert (promoted.zcard(pending), old.zcard(pending)) == (1, 0)
        # The consumer's blocking claim sat on the old master: it is dropped as a
        # connection error (Celery reconnects), and the reconnected consumer
        # claims from the new master.
        got: list[Any] = []
        errors: list[str] = []
        for _ in range(5):
            try:
                got = drain(conn, q, 1)
                break
            except conn.recoverable_connection_errors as exc:
                errors.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
                conn.ensure_connection(max_retries=5)
        assert got == [{"n": 2}], errors
        assert any(f"{new[1]}" in e for e in errors), errors
        assert (channel.client.connection.host, channel.client.connection.port) == new
        assert channel.store.client.connection_pool.get_master_address() == new
        assert promoted.zcard(pending) == 0
        promoted.close()
    finally:
        old.close()
        conn.release()


def test_sentinels_that_do_not_answer_hold_up_no_command(
    own_sentinel_topology: SentinelTopology, prefix: str
) -> None:
    """The master is asked about off the threads that use a pool."""
    topo = own_sentinel_topology
    conn = connect(topo, prefix)
    try:
        q = queue()
        producer = Producer(conn)
        producer.publish({"n": 0}, exchange=q.exchange, routing_key="q", declare=[q])
        store = conn.default_channel.store
        for s in topo.sentinels:
            assert s.proc is not None
            s.proc.send_signal(signal.SIGSTOP)
        try:
            # Several check periods pass while every sentinel hangs.
            slowest = 0.0
            deadline = time.monotonic() + 4 * MASTER_CHECK_S
            n = 0
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                producer.publish({"n": n}, exchange=q.exchange, routing_key="q", declare=[q])
                store.client.ping()
                slowest = max(slowest, time.monotonic() - t0)
                n += 1
                time.sleep(0.05)
        finally:
            for s in topo.sentinels:
                s.proc.send_signal(signal.SIGCONT)
        assert slowest < 0.5, slowest
        assert store.size("q") == n + 1
    finally:
        conn.release()


def _timed_ping(topo: SentinelTopology, prefix: str, limit_s: float, **topts: Any) -> float:
    """Connect anew and PING the master; return how long it took (at most ``limit_s``)."""
    took: list[float] = []

    def run() -> None:
        conn = connect(topo, prefix, lease_ms=3000, **topts)
        try:
            t0 = time.monotonic()
            channel: Any = conn.default_channel
            channel.client.ping()
            channel.store.client.ping()
            elapsed = time.monotonic() - t0
            # Every sentinel client the channel made: the store's timeout, one
            # attempt (a failure here leaves ``took`` empty: the test fails).
            for sentinel in channel._sentinels:
                for client in sentinel.sentinels:
                    kwargs = client.connection_pool.connection_kwargs
                    assert kwargs["socket_timeout"] == 1.0
                    assert kwargs["retry_on_error"] == []
                    assert client.connection_pool.make_connection().retry_on_error == []
            took.append(elapsed)
        finally:
            conn.release()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert took, f"no PING answered within {limit_s} s"
    return took[0]


@pytest.mark.parametrize("sentinel_kwargs", [None, {"socket_keepalive": True}])
def test_a_hung_first_sentinel_costs_a_connection_its_timeout_once(
    own_sentinel_topology: SentinelTopology, prefix: str, sentinel_kwargs: Any
) -> None:
    """The sentinel listed first hangs: connecting asks the others, and waits on it once."""
    topo = own_sentinel_topology
    hung = topo.sentinels[0]
    assert hung.proc is not None
    topts = {"sentinel_kwargs": sentinel_kwargs} if sentinel_kwargs else {}
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        # The store's socket timeout (one renewal interval of a 3 s lease, 1 s)
        # bounds the sentinels' too: a user's sentinel_kwargs keep it.
        first = _timed_ping(topo, prefix, 8, **topts)
        again = _timed_ping(topo, prefix, 8, **topts)
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    assert first < 2.5, first
    # Every later connection (a reconnect) skips the sentinel found silent.
    assert again < 0.5, again
