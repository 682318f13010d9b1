"""The transport contract, driven only through kombu's Connection/Producer/Consumer."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

import celery_emq  # noqa: F401  (registers emq://)
from celery_emq import EmqOptions, InvalidOptionError
from celery_emq.store.batch import Batch
from celery_emq.store.jobstore import JobStore
from celery_emq.transport import lease
from celery_emq.transport.lease import LeaseKeeper, keeper, parse_tag, worker_identity
from celery_emq.transport.settle import SettleBatcher, batcher
from celery_emq.transport.sweeper import Sweeper
from tests.conftest import CLUSTER, servers_of
from tests.transport.conftest import ConnFactory


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", lease_ms=30_000)


def job_id(message: Any) -> str:
    """Return the job id of a delivery (its tag is ``<job id>#<token>``)."""
    claim = parse_tag(message.delivery_tag)
    assert claim is not None
    return claim[0]


def queue(name: str = "q") -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def drain(conn: Connection, q: Queue, n: int, ack: bool = True, timeout: float = 5) -> list[Any]:
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append((body, message))
        if ack:
            message.ack()

    with Consumer(conn.channel(), [q], callbacks=[on_message], accept=["json"]):
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
    return got


def publish(conn: Connection, q: Queue, bodies: list[Any], **kw: Any) -> None:
    producer = Producer(conn.channel())
    for body in bodies:
        producer.publish(
            body,
            exchange=q.exchange,
            routing_key=q.routing_key,
            declare=[q],
            serializer="json",
            **kw,
        )


def test_roundtrip_acks_and_leaves_no_job(
    connect: ConnFactory, store: JobStore, prefix: str
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, [{"n": i} for i in range(10)])
    assert store.counts("q") == {"pending": 10, "active": 0, "delayed": 0, "dead": 0}
    got = drain(conn, q, 10)
    assert [b["n"] for b, _ in got] == list(range(10))
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert keeper().held_count(prefix) == 0


def test_a_deleted_queue_leaves_no_key_without_an_end(
    connect: ConnFactory, store: JobStore, client: redis.Redis
) -> None:
    conn, q = connect(), queue("gone")
    publish(conn, q, [{"n": 0}])
    assert len(drain(conn, q, 1)) == 1  # a completed job: its counter has a TTL
    publish(conn, q, [{"n": 1}, {"n": 2}])
    assert store.counts("gone")["pending"] == 2
    conn.default_channel.queue_delete("gone")
    assert store.counts("gone") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    left = list(client.scan_iter(match=store.keys("gone").base + "*", count=1000))
    assert left, "the completed count stays, for its 30 days"
    assert [k for k in left if client.pttl(k) == -1] == []


def test_lower_priority_number_is_consumed_first(connect: ConnFactory) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["late"], priority=9)
    publish(conn, q, ["early"], priority=0)
    publish(conn, q, ["middle"], priority=5)
    assert [b for b, _ in drain(conn, q, 3)] == ["early", "middle", "late"]


def test_unacked_message_holds_a_lease_until_ack(connect: ConnFactory, store: JobStore) -> None:
    conn, q = connect(lease_ms=2000), queue()
    publish(conn, q, ["x"])
    [(_, message)] = drain(conn, q, 1, ack=False)
    assert store.counts("q")["active"] == 1
    row = store.job("q", job_id(message))
    assert (row["owner"], row["deliveries"]) == (keeper().owner, "1")
    assert message.delivery_tag == f"{job_id(message)}#{row['claim']}"
    assert row["claim"].startswith("1.")
    time.sleep(2.5)  # past the lease: the keeper must have renewed it
    score = store.client.zscore(store.keys("q").active, job_id(message))
    assert score > store.server_ms()
    message.ack()
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def test_requeue_redelivers_marked(connect: ConnFactory, store: JobStore) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["x"])
    [(_, first)] = drain(conn, q, 1, ack=False)
    first.requeue()
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    [(_, second)] = drain(conn, q, 1)
    # The same job, claimed again: a new claim, so a new delivery tag.
    assert job_id(second) == job_id(first)
    assert first.delivery_tag.startswith(f"{job_id(first)}#1.")
    assert second.delivery_tag.startswith(f"{job_id(first)}#2.")
    assert second.delivery_info["redelivered"] is True
    assert second.headers["emq_deliveries"] == 2
    assert second.headers["emq_stalled"] == 0


def test_reject_without_requeue_goes_to_the_morgue(connect: ConnFactory, store: JobStore) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["x"])
    [(_, message)] = drain(conn, q, 1, ack=False)
    message.reject()
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}
    assert store.job("q", job_id(message))["last_error"] == "rejected"


def test_malformed_payload_is_dead_lettered_and_consuming_goes_on(
    connect: ConnFactory, store: JobStore
) -> None:
    from celery_emq.signals import job_dead_lettered

    seen: list[Any] = []

    def on_dead(sender: Any, job: Any, **kw: Any) -> None:
        seen.append(job)

    job_dead_lettered.connect(on_dead)
    try:
        conn, q = connect(dead_max_size=1), queue()
        publish(conn, q, ["before"])
        store.enqueue("q", "broken1", b"{not json")
        store.enqueue("q", "broken2", b'["no", "properties"]')
        publish(conn, q, ["after"])
        got = drain(conn, q, 2)
    finally:
        job_dead_lettered.disconnect(on_dead)
    assert [b for b, _ in got] == ["before", "after"]
    assert [(j.id, j.reason) for j in seen] == [("broken1", "malformed"), ("broken2", "malformed")]
    # Retention applies at the next sweep: dead_max_size=1 keeps the newest only.
    assert Sweeper(store, EmqOptions(dead_max_size=1)).sweep("q").trimmed == 1
    assert store.client.zrange(store.keys("q").dead, 0, -1) == [b"broken2"]
    row = store.job("q", "broken2")
    assert (row["state"], row["last_error"], row["reason"]) == ("dead", "malformed", "malformed")
    assert "TypeError" in row["error"]
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}


def test_a_body_kombu_cannot_decode_is_dead_lettered_not_redelivered(
    connect: ConnFactory, store: JobStore, prefix: str
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["before"])
    envelope = {"headers": {}, "content-type": "application/json", "content-encoding": "utf-8"}
    bad_padding = {**envelope, "body": "abc", "properties": {"body_encoding": "base64"}}
    unknown = {**envelope, "body": "abc", "properties": {"body_encoding": "rot13"}}
    store.enqueue("q", "padding", json.dumps(bad_padding))
    store.enqueue("q", "encoding", json.dumps(unknown))
    publish(conn, q, ["after"])
    got = drain(conn, q, 2)
    assert [b for b, _ in got] == ["before", "after"]
    rows = {j: store.job("q", j) for j in ("padding", "encoding")}
    assert {j: (r["state"], r["reason"]) for j, r in rows.items()} == {
        "padding": ("dead", "malformed"),
        "encoding": ("dead", "malformed"),
    }
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 2}
    assert keeper().held_count(prefix) == 0


def test_closing_a_channel_releases_unacked_at_once(
    connect: ConnFactory, store: JobStore, prefix: str
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["a", "b", "c"])
    got = drain(conn, q, 3, ack=False)
    assert len(got) == 3
    assert store.counts("q")["active"] == 3
    got[0][1].channel.close()
    assert store.counts("q") == {"pending": 3, "active": 0, "delayed": 0, "dead": 0}
    for _, message in got:
        row = store.job("q", job_id(message))
        assert (row["state"], row["stalled"]) == ("pending", "0")
    assert keeper().held_count(prefix) == 0


def test_a_release_that_fails_strands_no_other_claim(
    connect: ConnFactory, store: JobStore, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["a", "b", "c"])
    got = drain(conn, q, 3, ack=False)
    channel = got[0][1].channel
    release = JobStore.release
    failed: list[str] = []

    def flaky(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(args[1])
            raise redis.ConnectionError("Redis went away")
        return release(self, *args, **kwargs)

    monkeypatch.setattr(JobStore, "release", flaky)
    channel.close()
    # Nothing is left renewed for ever: the one release that failed is let go
    # (its lease lapses), the other two went back at once.
    assert keeper().held_count(prefix) == 0
    assert store.counts("q") == {"pending": 2, "active": 1, "delayed": 0, "dead": 0}
    assert store.client.zrange(store.keys("q").active, 0, -1) == [failed[0].encode()]


def test_an_ack_that_fails_keeps_the_claim_and_goes_through_later(
    connect: ConnFactory, store: JobStore, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["a", "b"])
    got = drain(conn, q, 2, ack=False)
    ack_many, execute = JobStore.ack_many, Batch.execute
    down = [True]

    def unreachable(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        if down[0]:
            raise redis.ConnectionError("Redis went away")
        return ack_many(self, *args, **kwargs)

    def batch_unreachable(self: Batch, **kwargs: Any) -> None:
        if down[0]:
            raise redis.ConnectionError("Redis went away")
        execute(self, **kwargs)

    # Acks are sent in batches (settle.py); the keeper retries owed ones alone.
    monkeypatch.setattr(Batch, "execute", batch_unreachable)
    monkeypatch.setattr(JobStore, "ack_many", unreachable)
    for _, message in got:
        message.ack()  # the tasks finished while Redis was unreachable
    # The claims stay held and renewed (no lapse, no stall, no second run) ...
    assert keeper().owed_count(prefix) == 2
    assert store.counts("q") == {"pending": 0, "active": 2, "delayed": 0, "dead": 0}
    # ... and the keeper acks them once Redis answers again.
    down[0] = False
    deadline = time.monotonic() + 10
    # The keeper forgets the claims just after Redis answered its ack.
    while (
        store.counts("q")["active"] or keeper().held_count(prefix)
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert keeper().owed_count(prefix) == keeper().held_count(prefix) == 0
    assert store.metrics("q")["completed"] == 2


def test_a_publish_retried_after_a_lost_reply_is_stored_once(
    connect: ConnFactory, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, q = connect(), queue()
    enqueue = JobStore.enqueue
    calls: list[str] = []

    def reply_lost(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        outcome = enqueue(self, *args, **kwargs)
        if len(calls) == 1:
            # Redis ran the script, then the connection dropped before the reply.
            raise redis.ConnectionError("connection reset by peer")
        return outcome

    monkeypatch.setattr(JobStore, "enqueue", reply_lost)
    with conn.Producer() as producer:
        producer.publish(
            {"n": 1},
            exchange=q.exchange,
            routing_key="q",
            declare=[q],
            serializer="json",
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0, "interval_step": 0},
        )
    # kombu published again on a fresh connection, under the same job id.
    assert len(calls) == 2 and calls[0] == calls[1]
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    [(body, message)] = drain(conn, q, 1)
    assert body == {"n": 1}
    # Republishing what was received is a new job, not a duplicate of the first.
    assert "emq_job_id" not in message.properties


def test_closing_keeps_a_claim_whose_task_started_elsewhere(
    connect: ConnFactory, store: JobStore
) -> None:
    # A start recorded in Redis keeps the claim held at a close, even when this
    # process's own list of started tasks is empty: the recorded start decides.
    conn, q = connect(), queue()
    publish(conn, q, ["started", "waiting"])
    got = drain(conn, q, 2, ack=False)
    tags = {body: message.delivery_tag for body, message in got}
    started_id, token = parse_tag(tags["started"])
    store.start("q", started_id, token)
    got[0][1].channel.close()
    assert store.counts("q") == {"pending": 1, "active": 1, "delayed": 0, "dead": 0}
    assert store.job("q", started_id)["state"] == "active"
    claim = keeper().get(tags["started"])
    assert claim is not None and (claim.job_id, claim.token) == (started_id, token)
    # Its task finishes later and its ack still lands.
    assert store.ack("q", started_id, token).name == "OK"
    keeper().forget(tags["started"])
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}


def test_basic_get(connect: ConnFactory, store: JobStore) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["a", "b"])
    bound = q(conn.channel())
    m = bound.get(no_ack=True)
    assert m.payload == "a"
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    m = bound.get()
    assert m.payload == "b"
    assert store.counts("q")["active"] == 1
    m.ack()
    assert bound.get() is None
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def test_size_and_purge(connect: ConnFactory, store: JobStore) -> None:
    conn, q = connect(), queue()
    publish(conn, q, list(range(25)))
    bound = q(conn.channel())
    assert bound.queue_declare().message_count == 25
    assert bound.purge() == 25
    assert store.counts("q")["pending"] == 0


def test_blocked_consumer_wakes_on_publish_without_polling(connect: ConnFactory) -> None:
    # With a 5 s BRPOP timeout a polling consumer would wait seconds; a woken
    # one returns as soon as the marker lands.
    conn, q = connect(polling_interval=5), queue()
    woke: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        woke.append(time.monotonic())
        message.ack()

    with Consumer(conn.channel(), [q], callbacks=[on_message], accept=["json"]):
        try:
            conn.drain_events(timeout=0.3)  # settle into the blocking wait
        except TimeoutError:
            pass
        sent: list[float] = []

        def later() -> None:
            time.sleep(0.5)
            with connect() as other:
                sent.append(time.monotonic())
                publish(other, q, ["ping"])

        t = threading.Thread(target=later)
        t.start()
        conn.drain_events(timeout=4)
        t.join()
    assert woke and sent
    assert woke[0] - sent[0] < 1.0


def test_an_expiring_queue_is_marked_in_use_and_its_rows_never_expire(
    connect: ConnFactory, store: JobStore
) -> None:
    conn = connect()
    q = Queue("tmp", Exchange("tmp", "direct"), "tmp", expires=30)
    publish(conn, q, ["x"])
    k = store.keys("tmp")
    [job] = store.client.zrange(k.pending, 0, -1)
    assert 0 < store.client.pttl(k.expires) <= 30_000
    for key in (k.pending, k.wake, k.seq, k.job(job.decode())):
        assert store.client.pttl(key) == -1, key
    assert store.client.smembers(store.expiring_key) == {b"tmp"}
    # An x-expires queue (a reply queue, say) is not a task queue.
    assert store.queues() == []


def test_a_no_ack_consumer_leaves_no_job_and_holds_no_claim(
    connect: ConnFactory, store: JobStore, prefix: str
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["a", "b", "c"])
    got: list[Any] = []
    with Consumer(
        conn.channel(), [q], callbacks=[lambda b, m: got.append(b)], no_ack=True, accept=["json"]
    ):
        deadline = time.monotonic() + 5
        while len(got) < 3 and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
    assert got == ["a", "b", "c"]
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert store.metrics("q")["completed"] == 3
    assert keeper().held_count(prefix) == 0


def test_fanout_broadcast_still_works(connect: ConnFactory) -> None:
    conn = connect()
    ex = Exchange("bcast", "fanout")
    got: list[Any] = []
    with Consumer(
        conn.channel(), [Queue("b1", ex)], callbacks=[lambda b, m: got.append(b)], no_ack=True
    ):
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass
        with connect() as other:
            Producer(other.channel(), exchange=ex).publish("hello", serializer="json")
        deadline = time.monotonic() + 3
        while not got and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
    assert got == ["hello"]


@pytest.mark.skipif(CLUSTER, reason="names one server by host and port")
def test_transport_by_import_path(redis_url: str, prefix: str, store: JobStore) -> None:
    from urllib.parse import urlparse

    u = urlparse(redis_url)
    with Connection(
        hostname=u.hostname,
        port=u.port,
        virtual_host=u.path.lstrip("/"),
        transport="celery_emq.transport:Transport",
        transport_options={"global_keyprefix": prefix},
    ) as conn:
        publish(conn, queue(), ["x"])
    assert store.counts("q")["pending"] == 1


def test_invalid_option_fails_by_name(connect: ConnFactory) -> None:
    with pytest.raises(InvalidOptionError, match="lease_ms"):
        connect(lease_ms=-1).channel()


def test_lease_survives_a_dropped_connection(
    connect: ConnFactory, store: JobStore, client: redis.Redis
) -> None:
    conn, q = connect(lease_ms=2000, client_name="emq-contract-drop"), queue()
    publish(conn, q, ["x"])
    [(_, message)] = drain(conn, q, 1, ack=False)
    # Drop every connection of this client, as a broker hiccup would.
    dropped = 0
    for server in servers_of(client):
        for c in server.client_list():
            if c.get("name") == "emq-contract-drop":
                server.client_kill_filter(_id=c["id"])
                dropped += 1
    assert dropped >= 1, "client_name names no connection"
    time.sleep(2.5)
    row = store.job("q", job_id(message))
    assert row["state"] == "active"
    assert store.client.zscore(store.keys("q").active, job_id(message)) > store.server_ms()
    message.ack()
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def test_a_job_whose_wake_marker_was_lost_is_still_claimed(
    connect: ConnFactory, store: JobStore
) -> None:
    # A consumer killed between its BRPOP and its claim takes the marker with it;
    # the job must not wait for the next publish.
    conn, q = connect(), queue()
    publish(conn, q, ["stranded"])
    store.client.delete(store.keys("q").wake)
    got = drain(conn, q, 1, timeout=5)
    assert [b for b, _ in got] == ["stranded"]
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


def consume_until(conn: Connection, got: list[Any], n: int, timeout: float) -> None:
    """Drain ``conn`` until ``got`` holds ``n`` deliveries or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass


@pytest.fixture
def own_keeper(monkeypatch: pytest.MonkeyPatch) -> LeaseKeeper:
    """A process keeper of this test's own: a suspect is handed only to a process holding nothing.

    (A claim another test left held in the process's keeper would keep it back.)
    """
    fresh = LeaseKeeper(worker_identity())
    monkeypatch.setattr(lease, "_keeper", fresh)
    return fresh


def test_a_suspect_received_whole_is_no_suspect_and_the_next_is_claimed_at_once(
    connect: ConnFactory, store: JobStore, prefix: str, own_keeper: LeaseKeeper
) -> None:
    # A job that lapsed before its task started may kill the process receiving
    # it. A claim takes one such suspect beside any other jobs; once its
    # delivery returns, the consumer received it whole: its lapses are
    # forgotten (no blame), and the next suspect is taken by the next claim.
    conn, q, q2 = connect(lease_ms=2000), queue("q"), queue("q2")
    k = store.keys("q")
    publish(conn, q, ["s1", "s2", "x"])
    publish(conn, q2, ["y"])
    ids = [i.decode() for i in store.client.zrange(k.pending, 0, -1)]
    for job_id in ids[:2]:
        store.client.hset(k.job(job_id), "lapsed", 1)
    got: list[Any] = []
    lapsed_at_delivery: list[tuple[str, str | None]] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        row = store.job("q", message.delivery_tag.partition("#")[0]) if body != "y" else {}
        lapsed_at_delivery.append((body, row.get("lapsed")))
        message.ack()

    began = time.monotonic()
    with Consumer(conn.channel(), [q, q2], callbacks=[on_message], accept=["json"]):
        consume_until(conn, got, 4, 5)
    assert sorted(got) == ["s1", "s2", "x", "y"]
    assert time.monotonic() - began < 2
    # Each suspect arrived as one: its row still counted its lapse...
    assert ("s1", "1") in lapsed_at_delivery and ("s2", "1") in lapsed_at_delivery
    # ... and the two came in claims of their own (one suspect a claim).
    assert (
        store.counts("q")
        == store.counts("q2")
        == {
            "pending": 0,
            "active": 0,
            "delayed": 0,
            "dead": 0,
        }
    )
    assert keeper().held_count(prefix) == 0


def test_a_suspect_delivered_is_recorded_received_before_the_next_claim(
    connect: ConnFactory, store: JobStore, own_keeper: LeaseKeeper
) -> None:
    conn, q = connect(lease_ms=4000), queue("q")
    k = store.keys("q")
    publish(conn, q, ["suspect"])
    [suspect_id] = [i.decode() for i in store.client.zrange(k.pending, 0, -1)]
    store.client.hset(k.job(suspect_id), "lapsed", 2)
    got: list[Any] = []
    with Consumer(conn.channel(), [q], callbacks=[lambda b, m: got.append(m)], accept=["json"]):
        consume_until(conn, got, 1, 5)
        row = store.job("q", suspect_id)
        # Received whole and not started: no lapse left to count, no blame.
        assert (row["state"], row.get("lapsed"), row.get("started")) == ("active", None, None)
        got[0].ack()


@contextlib.contextmanager
def acks_waiting(conn: Connection, q: Queue, on_message: Any) -> Iterator[SettleBatcher]:
    """Consume ``q`` with acks waiting for company, as in a ready worker, but for a minute."""
    b = batcher()
    saved = (b.delay_ms, b.deferring)
    try:
        with Consumer(conn.channel(), [q], callbacks=[on_message], accept=["json"]):
            b.delay_ms, b.deferring = 60_000, True
            yield b
    finally:
        b.flush()
        b.delay_ms, b.deferring = saved


def test_acks_waiting_to_be_sent_go_before_a_suspect_is_claimed(
    connect: ConnFactory, store: JobStore, prefix: str, own_keeper: LeaseKeeper
) -> None:
    # Inside a worker an ack waits a few ms for company (settle_delay_ms), its
    # claim already forgotten. A suspect claimed meanwhile, were it to kill the
    # process, would take the unsent ack with it: that task would run again.
    conn, q = connect(), queue()
    publish(conn, q, ["done"])
    got: list[Any] = []
    acked_before: list[int] = []  # jobs still active when the suspect arrived

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        if body == "done":
            message.ack()
        else:
            acked_before.append(store.counts("q")["active"])
            message.ack()

    with acks_waiting(conn, q, on_message) as b:
        consume_until(conn, got, 1, 5)
        assert got == ["done"]
        assert b.queued() == 1 and store.counts("q")["active"] == 1
        publish(conn, q, ["suspect"])
        [suspect_id] = [i.decode() for i in store.client.zrange(store.keys("q").pending, 0, -1)]
        store.client.hset(store.keys("q").job(suspect_id), "lapsed", 1)
        consume_until(conn, got, 2, 5)
        assert got == ["done", "suspect"]
        # Only the suspect was active: the ack had reached Redis before its claim.
        assert acked_before == [1]
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert keeper().held_count(prefix) == 0


def test_waiting_acks_are_sent_before_a_suspect_claimed_with_the_jobs_behind_it(
    connect: ConnFactory, store: JobStore, prefix: str, own_keeper: LeaseKeeper
) -> None:
    # The claim woken for the suspect takes it and the job behind it; the ack
    # waiting for company is sent, alone, before either is delivered, and the
    # wake list stays one marker per pending job.
    conn, q = connect(), queue()
    publish(conn, q, ["done"])
    got: list[Any] = []
    seen: list[tuple[int, int, int]] = []  # (active, pending, wake markers) at the suspect
    k = store.keys("q")

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        if body == "suspect":
            counts = store.counts("q")
            seen.append((counts["active"], counts["pending"], int(store.client.llen(k.wake))))
        message.ack()

    with acks_waiting(conn, q, on_message) as b:
        consume_until(conn, got, 1, 5)
        sends = b.sends
        publish(conn, q, ["suspect"])
        [suspect_id] = [i.decode() for i in store.client.zrange(k.pending, 0, -1)]
        store.client.hset(k.job(suspect_id), "lapsed", 1)
        publish(conn, q, ["after"])
        consume_until(conn, got, 3, 5)
        assert got == ["done", "suspect", "after"]
        # The waiting ack went first, alone in its send; both were claimed together.
        assert seen == [(2, 0, 0)]
        assert b.sends == sends + 1
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert keeper().held_count(prefix) == 0


def test_acks_waiting_for_company_stay_queued_while_plain_jobs_are_claimed(
    connect: ConnFactory, store: JobStore, prefix: str, own_keeper: LeaseKeeper
) -> None:
    # Only a suspect needs them sent first: sending them before every claim
    # would put one more round trip between an enqueue and its task's start.
    conn, q = connect(), queue()
    publish(conn, q, ["first"])
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with acks_waiting(conn, q, on_message) as b:
        consume_until(conn, got, 1, 5)
        sends = b.sends
        assert b.queued() == 1
        publish(conn, q, ["second"])
        consume_until(conn, got, 2, 5)
        assert got == ["first", "second"]
        # Both acks wait together; none was sent for the second claim.
        assert (b.sends, b.queued()) == (sends, 2)
        assert store.counts("q")["active"] == 2
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert keeper().held_count(prefix) == 0


#: What a message is published with: kombu must give every part of it back.
PUBLISHED_HEADERS = {"x-trace": "t-1", "n": 3, "nested": {"a": [1, 2]}, "emq_group_like": "no"}
PUBLISHED_PROPERTIES = {"priority": 7, "correlation_id": "c-1", "reply_to": "replies"}


def simple_roundtrip(url: str, requeue: bool = False, **topts: Any) -> list[tuple[Any, ...]]:
    """Put one message through ``SimpleQueue`` and get it (and, with ``requeue``, again).

    Returns, per delivery: body, headers, properties (but the delivery tag,
    which names one delivery) and whether it was redelivered.
    """
    out: list[tuple[Any, ...]] = []
    with Connection(url, transport_options=topts) as conn, conn.SimpleQueue("sq") as sq:
        sq.put({"hello": "world"}, headers=dict(PUBLISHED_HEADERS), **PUBLISHED_PROPERTIES)
        for again in [False, True] if requeue else [False]:
            message = sq.get(timeout=5)
            properties = {k: v for k, v in message.properties.items() if k != "delivery_tag"}
            redelivered = properties.pop("delivery_info", {}).get("redelivered", False)
            out.append((message.payload, message.headers, properties, redelivered))
            if requeue and not again:
                message.requeue()
            else:
                message.ack()
    return out


def test_simple_queue_gets_back_exactly_what_it_put(broker_url: str, prefix: str) -> None:
    [(body, headers, properties, redelivered)] = simple_roundtrip(
        broker_url, global_keyprefix=prefix
    )
    assert body == {"hello": "world"}
    # No internal bookkeeping (the claim travels in the delivery tag, not a header).
    assert headers == PUBLISHED_HEADERS
    assert {k: properties[k] for k in PUBLISHED_PROPERTIES} == PUBLISHED_PROPERTIES
    assert not redelivered
    # The same as kombu's in-memory transport gives back.
    [stock] = simple_roundtrip("memory://")
    assert (body, headers, properties) == stock[:3]


def test_a_redelivery_adds_only_the_documented_emq_headers(broker_url: str, prefix: str) -> None:
    first, second = simple_roundtrip(broker_url, requeue=True, global_keyprefix=prefix)
    assert first[1] == PUBLISHED_HEADERS
    # What a task reads from self.request: its stall count and delivery count.
    assert second[1] == {**PUBLISHED_HEADERS, "emq_stalled": 0, "emq_deliveries": 2}
    assert second[2] == first[2]
    assert (first[3], second[3]) == (False, True)


def test_producer_and_consumer_see_headers_properties_and_priority_as_published(
    connect: ConnFactory,
) -> None:
    conn, q = connect(), queue()
    publish(conn, q, ["x"], headers=dict(PUBLISHED_HEADERS), **PUBLISHED_PROPERTIES)
    [(body, message)] = drain(conn, q, 1)
    assert body == "x"
    assert message.headers == PUBLISHED_HEADERS
    assert {k: message.properties[k] for k in PUBLISHED_PROPERTIES} == PUBLISHED_PROPERTIES
    assert message.properties["delivery_tag"] == message.delivery_tag


def in_the_idle_wait(connect: ConnFactory) -> tuple[Connection, Queue, Any]:
    """A consumer of a new queue sitting in a 30 s idle wait: its connection, queue, channel."""
    conn, q = connect(idle_wait_s=30), queue()
    channel = conn.channel()
    consumer = Consumer(channel, [q], callbacks=[lambda body, message: None], accept=["json"])
    consumer.consume()
    into_the_idle_wait(conn, channel)
    return conn, q, channel


def into_the_idle_wait(conn: Connection, channel: Any) -> None:
    """Drain until ``channel`` sits in its long wait (after its first look at its queues)."""
    for _ in range(3):
        try:
            conn.drain_events(timeout=0.3)
        except TimeoutError:
            pass
    assert channel._in_poll


def test_closing_a_consumer_in_its_idle_wait_does_not_wait_it_out(
    connect: ConnFactory, store: JobStore
) -> None:
    # An idle wait lasts seconds: a warm shutdown must not sit through it.
    _, q, channel = in_the_idle_wait(connect)
    began = time.monotonic()
    channel.close()
    # The wait had about 7 s to run.
    assert time.monotonic() - began < 4
    # Nothing was popped by the wait that was cut short: a publish still wakes the next consumer.
    with connect() as other:
        publish(other, q, ["after"])
    got = drain(connect(), q, 1, timeout=5)
    assert [b for b, _ in got] == ["after"]


@pytest.mark.skipif(CLUSTER, reason="a Cluster channel waits in its wakers' threads")
def test_closing_after_the_wait_connection_was_reset_closes_the_channel(
    connect: ConnFactory,
) -> None:
    # Redis restarted (or failed over) during the idle wait and the worker
    # reconnects through another connection: the old channel must still close.
    _, _, channel = in_the_idle_wait(connect)
    # Only this channel's own connection (other clients share the server), on
    # the server it waits on (a Cluster's node, a Sentinel's master).
    sock = channel._in_poll._sock
    host, port = sock.getsockname()[:2]
    server_host, server_port = sock.getpeername()[:2]
    with redis.Redis(host=server_host, port=server_port) as server:
        server.client_kill_filter(addr=f"{host}:{port}")
    time.sleep(0.2)
    channel.close()
    assert channel.closed
    assert not channel._in_poll


def test_a_queue_consumed_during_the_idle_wait_is_waited_on_at_once(
    connect: ConnFactory,
) -> None:
    # The wait in flight names the queues consumed when it began; a queue
    # consumed later (a reply queue of `celery inspect`, add_consumer) must
    # not wait for it to end.
    conn, q1, q2 = connect(idle_wait_s=30, socket_timeout=60), queue("q1"), queue("q2")
    channel = conn.channel()
    got: list[Any] = []
    Consumer(channel, [q1], callbacks=[lambda b, m: got.append(b)], accept=["json"]).consume()
    into_the_idle_wait(conn, channel)
    Consumer(
        channel, [q2], callbacks=[lambda b, m: got.append(b)], accept=["json"], no_ack=True
    ).consume()
    with connect() as other:
        publish(other, q2, ["reply"])
    consume_until(conn, got, 1, 4)
    assert got == ["reply"]


OWN_EMQ_HEADERS = {"emq_stalled": "publisher's", "emq_deliveries": 41}


def test_a_publishers_own_emq_named_headers_come_back_as_published(connect: ConnFactory) -> None:
    conn, q = connect(), queue()
    headers = {**PUBLISHED_HEADERS, **OWN_EMQ_HEADERS}
    publish(conn, q, ["x"], headers=dict(headers))
    [(_, message)] = drain(conn, q, 1)
    assert message.headers == headers


def test_a_celery_retry_drops_the_counts_it_copied_from_a_redelivered_request(
    connect: ConnFactory,
) -> None:
    # Celery's retry copies a request's custom headers: the counts of the delivery
    # that retried say nothing of the new message, which starts at its first delivery.
    conn, q = connect(), queue()
    task = {"task": "proj.t", "id": "t-1", "retries": 1, "x-trace": "t-1"}
    publish(conn, q, ["x"], headers={**task, **OWN_EMQ_HEADERS})
    [(_, message)] = drain(conn, q, 1)
    assert message.headers == task
