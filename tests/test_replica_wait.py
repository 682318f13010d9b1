"""wait_replicas: publishes and settles ask Redis how many replicas hold them (WAIT)."""

from __future__ import annotations

import logging
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import OperationalError

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq.errors import InvalidOptionError, ReplicasUnconfirmedError
from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.lease import keeper, parse_tag
from celery_emq.transport.messages import JOB_ID_PROPERTY
from celery_emq.transport.settle import batcher

from .topology.sentinel_servers import SentinelTopology


def test_options_default_off_and_are_validated_by_name() -> None:
    o = EmqOptions.from_transport_options({})
    assert (o.wait_replicas, o.wait_timeout_ms) == (0, 1000)
    o = EmqOptions.from_transport_options({"wait_replicas": 2, "wait_timeout_ms": 250})
    assert (o.wait_replicas, o.wait_timeout_ms) == (2, 250)
    for name, bad in [
        ("wait_replicas", -1),
        ("wait_replicas", "1"),
        ("wait_replicas", True),
        ("wait_timeout_ms", 0),
        ("wait_timeout_ms", 1.5),
    ]:
        with pytest.raises(InvalidOptionError) as err:
            EmqOptions.from_transport_options({name: bad})
        assert name in str(err.value)


def q() -> Queue:
    return Queue("q", Exchange("q", "direct"), routing_key="q")


def waits(client: redis.Redis) -> int:
    """How many WAIT commands the server has run."""
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def publish(conn: Connection, body: Any) -> None:
    Producer(conn).publish(body, exchange="q", routing_key="q", declare=[q()], serializer="json")


@pytest.fixture
def solo_conn(redis_url: str, prefix: str) -> Iterator[Connection]:
    """The machine's Redis (no replica), asking for one replica within 50 ms."""
    c = Connection(
        redis_url.replace("redis://", "emq://", 1),
        transport_options={"global_keyprefix": prefix, "wait_replicas": 1, "wait_timeout_ms": 50},
    )
    yield c
    c.release()


def test_a_publish_no_replica_confirms_raises_and_a_retry_does_not_duplicate(
    solo_conn: Connection, store: JobStore, client: redis.Redis
) -> None:
    before = waits(client)
    with pytest.raises(ReplicasUnconfirmedError) as err:
        publish(solo_conn, {"n": 1})
    assert isinstance(err.value, OperationalError)
    assert "may or may not survive a failover" in str(err.value)
    assert (err.value.queue, err.value.confirmed, err.value.wanted) == ("q", 0, 1)
    assert waits(client) == before + 1
    # The write itself stands on the master.
    assert store.counts("q")["pending"] == 1
    # Published again with the job id the error names (what kombu's own retry
    # of the same message does), it is the same job, not a second one.
    channel = solo_conn.default_channel
    message = channel.prepare_message('{"n": 1}', properties={JOB_ID_PROPERTY: err.value.job_id})
    with pytest.raises(ReplicasUnconfirmedError):
        channel._put("q", message)
    assert store.counts("q")["pending"] == 1


def test_a_settle_no_replica_confirms_is_done_and_warned(
    solo_conn: Connection, store: JobStore, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    plain = Connection(
        solo_conn.as_uri(), transport_options={**solo_conn.transport_options, "wait_replicas": 0}
    )
    try:
        publish(plain, {"n": 1})
        message = solo_conn.default_channel.basic_get("q")
        assert message is not None
        before = waits(client)
        with caplog.at_level(logging.WARNING, logger="celery_emq.transport.settle"):
            message.ack()
        assert waits(client) == before + 1
        assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
        [warning] = [r for r in caplog.records if "replica" in r.getMessage()]
        assert "may run again" in warning.getMessage() and "failover" in warning.getMessage()
    finally:
        plain.release()


def test_off_by_default_sends_no_wait(
    redis_url: str, prefix: str, store: JobStore, client: redis.Redis
) -> None:
    c = Connection(
        redis_url.replace("redis://", "emq://", 1), transport_options={"global_keyprefix": prefix}
    )
    try:
        before = waits(client)
        publish(c, {"n": 1})
        message = c.default_channel.basic_get("q")
        message.ack()
        assert waits(client) == before
    finally:
        c.release()


@pytest.fixture(scope="module")
def topo() -> Iterator[SentinelTopology]:
    from tests.faults.servers import REDIS_SERVER

    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    with SentinelTopology() as t:
        yield t


def test_with_a_replica_publish_start_and_ack_are_each_confirmed(topo: SentinelTopology) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    master = redis.Redis.from_url(topo.master_url(2))
    replica = redis.Redis(host="127.0.0.1", port=topo.replica.port, db=2)
    conn = Connection(
        topo.broker_url(2),
        transport_options={
            "master_name": topo.master_name,
            "global_keyprefix": prefix,
            "wait_replicas": 1,
            "wait_timeout_ms": 5000,
        },
    )
    try:
        # The first calls load the scripts on the fresh server (a round trip
        # more, with its own WAIT): counted from the second job on.
        publish(conn, {"n": 0})
        first = conn.default_channel.basic_get("q")
        warm = keeper().forget(first.delivery_tag)
        assert warm is not None
        batcher().start_now(warm)
        batcher().ack([warm])
        before = waits(master)
        publish(conn, {"n": 1})
        assert waits(master) == before + 1
        # Confirmed: the replica holds the job the moment the publish returned.
        assert replica.zcard(f"{prefix}emq:{{q}}:pending") == 1
        message = conn.default_channel.basic_get("q")
        job_id, _token = parse_tag(message.delivery_tag)
        claim = keeper().forget(message.delivery_tag)
        assert claim is not None
        batcher().start_now(claim)
        assert waits(master) == before + 2
        assert replica.hget(f"{prefix}emq:{{q}}:job:{job_id}", "started") is not None
        batcher().ack([claim])
        assert waits(master) == before + 3
        assert replica.exists(f"{prefix}emq:{{q}}:job:{job_id}") == 0
    finally:
        conn.release()
        master.close()
        replica.close()


def test_a_lost_script_is_run_again_and_its_write_confirmed_too(
    store: JobStore, client: redis.Redis
) -> None:
    own = JobStore(store.client, store.prefix, store.lease_ms, wait_replicas=1, wait_timeout_ms=20)
    own.scripts.registered["enqueue"].sha = "0" * 40  # as if the server had lost it (a failover)
    before = waits(client)
    with pytest.raises(ReplicasUnconfirmedError):
        own.enqueue("q", "a", "{}")
    # The first round trip's WAIT, then the one after the write that ran.
    assert waits(client) == before + 2
    assert own.counts("q")["pending"] == 1


def test_a_duplicate_publish_is_confirmed_by_a_write_of_its_own(topo: SentinelTopology) -> None:
    # A retried publish finds its job already stored and would write nothing;
    # WAIT counts the replicas holding this connection's writes, so on a
    # connection that wrote nothing it counts every replica at once, whether or
    # not the job reached them. With the replica frozen, the first publish is
    # unconfirmed, and the same publish again, on a new connection, must be too.
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    master = redis.Redis.from_url(topo.master_url(2))
    retry = redis.Redis.from_url(topo.master_url(2))
    assert topo.replica.proc is not None
    pid = topo.replica.proc.pid
    try:
        first = JobStore(master, prefix + "emq", 30_000, wait_replicas=1, wait_timeout_ms=300)
        again = JobStore(retry, prefix + "emq", 30_000, wait_replicas=1, wait_timeout_ms=300)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplicasUnconfirmedError):
                first.enqueue("q", "j1", "{}")
            with pytest.raises(ReplicasUnconfirmedError):
                again.enqueue("q", "j1", "{}")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert first.counts("q")["pending"] == 1
    finally:
        for key in master.scan_iter(prefix + "*"):
            master.delete(key)
        master.close()
        retry.close()


def test_the_store_waits_long_enough_for_a_whole_wait(redis_url: str, prefix: str) -> None:
    # A WAIT may block wait_timeout_ms: the store's socket must not time out
    # first (the reply would be lost and the publish retried as a failure).
    c = Connection(
        redis_url.replace("redis://", "emq://", 1),
        transport_options={
            "global_keyprefix": prefix,
            "lease_ms": 3000,
            "wait_replicas": 1,
            "wait_timeout_ms": 2000,
        },
    )
    try:
        assert c.default_channel.store_timeout_s >= 2.5
        plain = Connection(c.as_uri(), transport_options={"lease_ms": 3000})
        try:
            # Without replica waits, a renewal stuck on a dead link fails fast.
            assert plain.default_channel.store_timeout_s == 1.0
        finally:
            plain.release()
    finally:
        c.release()


def test_a_stored_publish_is_not_reported_failed_by_the_registry(
    redis_url: str, prefix: str, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The queue registry lives apart (on a cluster, on another master). A
    # publish whose job is stored succeeds even if recording the queue there
    # fails: reported failed, it would be published again under a new job id.
    c = Connection(
        redis_url.replace("redis://", "emq://", 1), transport_options={"global_keyprefix": prefix}
    )
    try:
        channel = c.default_channel

        def down(queue: str) -> None:
            raise redis.ConnectionError("the registry's master is failing over")

        monkeypatch.setattr(channel.store, "register", down)
        Producer(c).publish(
            {"n": 1},
            exchange="q",
            routing_key="q",
            declare=[q()],
            serializer="json",
            headers={"task": "proj.t", "id": "t1"},  # a task message: its queue is registered
        )
        assert store.counts("q")["pending"] == 1
    finally:
        c.release()
