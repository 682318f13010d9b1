"""The wakers of a cluster channel: they survive errors, keep no marker they cannot use."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kombu import Connection, Consumer, Producer
from redis.exceptions import RedisClusterException

import celery_emq.transport.cluster
from celery_emq.transport.cluster import ClusterChannel

from .test_cluster import ConnFactory, connect, drain, queue, spread_names

__all__ = ["connect"]  # the fixture, for this module's tests


def _wake_len(channel: ClusterChannel, name: str) -> int:
    """How many wake markers wait in ``name``'s wake list."""
    return int(channel.store.client.llen(channel.store.keys(name).wake))


def _wakers(channel: ClusterChannel) -> list[threading.Thread]:
    """The channel's waker threads still running."""
    return [
        t for t in threading.enumerate() if getattr(t, "_channel", None) is channel and t.is_alive()
    ]


def _publish(conn: Connection, name: str, body: Any) -> None:
    q = queue(name)
    Producer(conn.default_channel).publish(
        body, exchange=q.exchange, routing_key=q.routing_key, declare=[q]
    )


def test_a_waker_keeps_waiting_after_its_client_failed_to_connect(
    connect: ConnFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wakers' client connects when first built: during a failover no
    # seed node may answer, and the waker must try again, not die.
    name = spread_names(1)[0]
    _publish(connect(), name, {"warm": 1})
    conn = connect()
    got: list[Any] = []
    real = celery_emq.transport.cluster.cluster_class
    failures = [1]

    def flaky(retries: int) -> Any:
        cls = real(retries)

        def build(**kwargs: Any) -> Any:
            if failures:
                failures.pop()
                raise RedisClusterException("Redis Cluster cannot be connected")
            return cls(**kwargs)

        return build

    with Consumer(conn.channel(), [queue(name)], callbacks=[lambda b, m: (got.append(b), m.ack())]):
        # The store's client exists (the declare used it): the next client
        # built is the wakers'.
        monkeypatch.setattr(celery_emq.transport.cluster, "cluster_class", flaky)
        drain(conn, got, 1, timeout=5)
        assert not failures
        assert got == [{"warm": 1}]
        _publish(connect(), name, {"n": 2})
        drain(conn, got, 2, timeout=5)
    assert got == [{"warm": 1}, {"n": 2}]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_waker_that_died_is_replaced(
    connect: ConnFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = spread_names(1)[0]
    conn = connect()
    got: list[Any] = []
    real_woke = ClusterChannel._woke
    kills = [1]

    def woke(self: ClusterChannel, queue: str) -> None:
        if kills:
            kills.pop()
            raise SystemExit  # ends the waker's thread (no Exception: nothing catches it)
        real_woke(self, queue)

    monkeypatch.setattr(ClusterChannel, "_woke", woke)
    with Consumer(conn.channel(), [queue(name)], callbacks=[lambda b, m: (got.append(b), m.ack())]):
        drain(conn, [], 1, timeout=1.5)  # the waker waits
        _publish(connect(), name, {"n": 1})
        drain(conn, got, 1, timeout=5)
        assert not kills
        assert got == [{"n": 1}]
        _publish(connect(), name, {"n": 2})
        t0 = time.monotonic()
        drain(conn, got, 2, timeout=5)
        # A live waker: woken by the marker, not found by a scan a second later.
        assert got == [{"n": 1}, {"n": 2}]
        assert time.monotonic() - t0 < 0.5


def test_a_full_prefetch_leaves_other_queues_markers_for_other_consumers(
    connect: ConnFactory,
) -> None:
    first, second = spread_names(2)
    conn = connect()
    channel = conn.default_channel
    got: list[Any] = []
    with Consumer(
        channel, [queue(first), queue(second)], callbacks=[lambda b, m: got.append(b)]
    ) as consumer:
        consumer.qos(prefetch_count=1)
        drain(conn, [], 1, timeout=1.5)  # a waker per slot waits
        _publish(connect(), first, {"n": 1})
        drain(conn, got, 1, timeout=5)
        assert got == [{"n": 1}]  # not acked: the prefetch is full
        _publish(connect(), second, {"n": 2})
        drain(conn, got, 2, timeout=2.5)
        assert got == [{"n": 1}]
        # The marker waits for a consumer that can take the job.
        assert _wake_len(channel, second) == 1
        assert not channel._popped


def test_close_waits_for_its_wakers_and_gives_back_a_marker_popped_meanwhile(
    connect: ConnFactory,
) -> None:
    name = spread_names(1)[0]
    conn = connect()
    channel = conn.channel()
    consumer = Consumer(channel, [queue(name)], callbacks=[])
    consumer.consume()
    drain(conn, [], 1, timeout=1.5)  # the waker waits
    assert len(_wakers(channel)) == 1
    publisher = connect()
    _publish(publisher, "warm", {})  # connected before the close starts
    timer = threading.Timer(0.05, _publish, (publisher, name, {"n": 1}))
    timer.start()
    channel.close()
    timer.join()
    assert _wakers(channel) == []
    assert _wake_len(publisher.default_channel, name) == 1


def test_a_cancelled_consumer_leaves_its_queues_markers(connect: ConnFactory) -> None:
    name = spread_names(1)[0]
    conn = connect()
    channel = conn.default_channel
    consumer = Consumer(channel, [queue(name)], callbacks=[])
    consumer.consume()
    drain(conn, [], 1, timeout=1.5)  # the waker waits
    consumer.cancel()
    drain(conn, [], 1, timeout=0.5)
    _publish(connect(), name, {"n": 1})
    time.sleep(1.5)
    assert _wake_len(channel, name) == 1
    assert _wakers(channel) == []


def test_close_does_not_wait_out_its_wakers_idle_waits(connect: ConnFactory) -> None:
    # A waker's idle wait lasts seconds: a warm shutdown must not sit through it.
    names = spread_names(2)
    conn = connect(idle_wait_s=30, socket_timeout=60)
    channel = conn.channel()
    Consumer(channel, [queue(n) for n in names], callbacks=[]).consume()
    drain(conn, [], 1, timeout=1.5)  # the wakers wait
    assert len(_wakers(channel)) == 2
    began = time.monotonic()
    channel.close()
    # Their waits had about 12 s to run.
    assert time.monotonic() - began < 4
    assert _wakers(channel) == []
