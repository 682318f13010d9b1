"""The settle batcher: acks and start records sent together, in one round trip."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.connection import AbstractConnection

from celery_emq.store.batch import Batch
from celery_emq.store.jobstore import JobStore
from celery_emq.store.loader import Loaded
from celery_emq.store.outcomes import Outcome
from celery_emq.transport import settle
from celery_emq.transport.lease import Claim, LeaseKeeper
from celery_emq.transport.settle import SETTLE_BATCH, SettleBatcher
from tests.conftest import ManualKeeper, bulk_enqueue, started_mark

ROUND_TRIP_WAIT_S = 5


@pytest.fixture
def owed_to(monkeypatch: pytest.MonkeyPatch) -> LeaseKeeper:
    """The keeper a failed ack is owed to (a manual one, not the process's own)."""
    k = ManualKeeper("me")
    monkeypatch.setattr(settle, "keeper", lambda: k)
    return k


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch, prefix: str) -> list[bytes]:
    """Every command (or whole pipeline) on this test's keys sent from now on: one round trip each.

    Only those naming the test's prefix: a thread an earlier test left behind (a
    sweep on a hung node ends its wait later) may still send its own.
    """
    sent: list[bytes] = []
    original = AbstractConnection.send_packed_command
    mine = prefix.encode()

    def counted(self: Any, command: Any, check_health: bool = True) -> Any:
        head = command if isinstance(command, bytes) else b"".join(command)
        if mine in head:
            sent.append(head)
        return original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    return sent


def claims_of(store: JobStore, queue: str, ids: list[str]) -> list[Claim]:
    for job_id in ids:
        store.enqueue(queue, job_id, b"{}")
    claimed = store.claim(queue, "me", count=len(ids))
    assert [c.id for c in claimed] == ids
    return [Claim(store, queue, c.id, c.token) for c in claimed]


def deferring(delay_ms: int) -> SettleBatcher:
    b = SettleBatcher()
    b.delay_ms = delay_ms
    b.deferring = True
    return b


def wait_until(cond: Callable[[], bool], timeout: float = ROUND_TRIP_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_outside_a_worker_an_ack_is_sent_when_made(store: JobStore) -> None:
    b = SettleBatcher()
    b.delay_ms = 60_000  # a consuming channel asked for it, but no worker is ready here
    [claim] = claims_of(store, "q", ["a"])
    b.ack([claim])
    assert store.job("q", "a") == {}
    assert b.queued() == 0


def test_deferred_settles_wait_then_go_together_in_one_round_trip(
    store: JobStore, round_trips: list[bytes]
) -> None:
    b = deferring(200)
    a1, a2 = claims_of(store, "q1", ["a1", "a2"])
    [b1] = claims_of(store, "q2", ["b1"])
    [s1] = claims_of(store, "q2", ["s1"])
    round_trips.clear()
    b.ack([a1])
    b.ack([a2])
    b.ack([b1])
    b.start(s1)
    assert b.queued() == 4
    assert round_trips == []
    assert store.job("q1", "a1")["state"] == "active"
    wait_until(lambda: store.job("q2", "b1") == {} and store.job("q1", "a2") == {})
    # Two queues' acks and a start record: one pipeline, one round trip (the
    # test's own reads are the other round trips).
    [sent] = [r for r in round_trips if b"EVALSHA" in r]
    assert sent.count(b"EVALSHA") == 3
    assert store.counts("q1") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert store.counts("q2") == {"pending": 0, "active": 1, "delayed": 0, "dead": 0}
    assert store.job("q2", "s1")["started"] == started_mark(s1.token)
    assert store.metrics("q1")["completed"] == 2
    assert store.metrics("q2")["completed"] == 1
    assert b.sends == 1


def test_a_full_batch_is_sent_at_once(store: JobStore) -> None:
    b = deferring(60_000)
    ids = bulk_enqueue(store, "q", SETTLE_BATCH)
    claimed = store.claim("q", "me", count=SETTLE_BATCH)
    claims = [Claim(store, "q", c.id, c.token) for c in claimed]
    for claim in claims[:-1]:
        b.ack([claim])
    assert store.counts("q")["active"] == len(ids)
    b.ack([claims[-1]])
    # No wait for the delay: the batch was full.
    assert b.queued() == 0
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert b.sends == 1


def test_a_start_sent_now_carries_the_queued_acks(
    store: JobStore, round_trips: list[bytes]
) -> None:
    b = deferring(60_000)
    done, running = claims_of(store, "q", ["done", "running"])
    b.ack([done])
    round_trips.clear()
    b.start_now(running)
    assert len(round_trips) == 1
    assert store.job("q", "done") == {}
    assert store.job("q", "running")["started"] == started_mark(running.token)
    assert b.queued() == 0


@contextlib.contextmanager
def starts_queued_behind_a_send(
    b: SettleBatcher,
    claims: list[Claim],
    run: Callable[[Claim], None],
    first_sending: threading.Event,
    release: Callable[[], None],
) -> Iterator[None]:
    """Run each claim's thread: the first until its send is under way, then the others until queued.

    On leaving, ``release`` lets the held sends go and every thread is joined.
    """
    threads = [threading.Thread(target=run, args=(c,)) for c in claims]
    try:
        threads[0].start()
        assert first_sending.wait(ROUND_TRIP_WAIT_S)
        for t in threads[1:]:
            t.start()
        wait_until(lambda: len(b._starts) == len(claims) - 1)
        yield
    finally:
        release()
        for t in threads:
            t.join(ROUND_TRIP_WAIT_S)


def test_starts_made_while_a_send_is_under_way_go_together_in_the_next(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pool threads each record a start before their task's body runs: those
    # that arrive while one is being sent share the next round trip, and each
    # returns only once the send carrying its own record has returned.
    b = deferring(60_000)
    first, *others = claims_of(store, "q", ["t1", "t2", "t3"])
    entered = [threading.Event(), threading.Event()]
    released = [threading.Event(), threading.Event()]
    sent: list[list[str]] = []
    send = b._send

    def held_send(acks: list[Claim], starts: list[Claim], receipts: Any = ()) -> None:
        n = len(sent)
        sent.append(sorted(c.job_id for c in starts))
        if n < 2:
            entered[n].set()
            released[n].wait(ROUND_TRIP_WAIT_S)
        send(acks, starts, receipts)

    monkeypatch.setattr(b, "_send", held_send)
    recorded: dict[str, str | None] = {}

    def run(claim: Claim) -> None:
        b.start_now(claim)
        recorded[claim.job_id] = store.job("q", claim.job_id).get("started")

    def release_all() -> None:
        for e in released:
            e.set()

    with starts_queued_behind_a_send(b, [first, *others], run, entered[0], release_all):
        released[0].set()
        assert entered[1].wait(ROUND_TRIP_WAIT_S)
        # The second send is under way: neither of its threads has returned.
        time.sleep(0.05)
        assert list(recorded) == ["t1"]
    assert sent == [["t1"], ["t2", "t3"]]
    assert recorded == {c.job_id: started_mark(c.token) for c in (first, *others)}
    assert b.queued() == 0


def test_a_start_whose_send_fails_in_another_thread_fails_there_too(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread that sends a shared round trip is not the only one whose
    # record it carried: every thread waiting on it hears that it failed.
    b = deferring(60_000)
    first, *others = claims_of(store, "q", ["t1", "t2", "t3"])
    in_send, go_on = threading.Event(), threading.Event()
    sends: list[int] = []
    send = b._send

    def failing_second(acks: list[Claim], starts: list[Claim], receipts: Any = ()) -> None:
        sends.append(len(starts))
        if len(sends) == 1:
            in_send.set()
            go_on.wait(ROUND_TRIP_WAIT_S)
            send(acks, starts, receipts)
            return
        raise RuntimeError("lanes closed")

    monkeypatch.setattr(b, "_send", failing_second)
    outcome: dict[str, str] = {}

    def run(claim: Claim) -> None:
        try:
            b.start_now(claim)
        except Exception as exc:
            outcome[claim.job_id] = str(exc)
        else:
            outcome[claim.job_id] = "recorded"

    with starts_queued_behind_a_send(b, [first, *others], run, in_send, go_on.set):
        pass
    assert sends == [1, 2]
    assert outcome["t1"] == "recorded"
    assert "lanes closed" in outcome["t2"] and "lanes closed" in outcome["t3"]
    assert "started" not in store.job("q", "t2") and "started" not in store.job("q", "t3")
    assert b.queued() == 0 and b._start_errors == {} and b._starting == set()


class _Interrupted(BaseException):
    pass


class _InterruptingLock:
    def __enter__(self) -> None:
        raise _Interrupted

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_start_interrupted_before_its_send_leaves_nothing_queued(store: JobStore) -> None:
    # A gevent timeout may end the wait for the send: no record is left to be
    # sent later for a body that never ran, and nothing waits in alone().
    b = deferring(60_000)
    [claim] = claims_of(store, "q", ["a"])
    b._send_lock = _InterruptingLock()  # type: ignore[assignment]
    with pytest.raises(_Interrupted):
        b.start_now(claim)
    assert b.queued() == 0 and b._starting == set()


def test_a_start_and_its_ack_in_one_batch_leave_the_start_on_record(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task done within the delay: its start record goes too, written before its ack.

    A server that loses its last writes keeps a first part of them: losing the
    ack, it keeps the start written before it, and the lapse is a stall.
    """
    sent: list[tuple[Loaded, str, list[str], list[Any]]] = []
    original = Batch._send

    def send(self: Batch, calls: list[Any], confirm: Any, load: bool, client: Any = None) -> Any:
        sent.extend((self._scripts, *call) for call in calls)
        return original(self, calls, confirm, load, client)

    monkeypatch.setattr(Batch, "_send", send)
    b = deferring(60_000)
    finished, running = claims_of(store, "q", ["finished", "running"])
    k = store.keys("q")
    row = store.client.dump(k.job_prefix + "finished")
    deadline = store.client.zscore(k.active, "finished")
    b.start(finished)
    b.start(running)
    b.ack([finished])
    b.flush()
    assert b.sends == 1
    assert [(name, keys[0] if name == "start" else args) for _, name, keys, args in sent] == [
        ("start", k.job_prefix + "finished"),
        ("start", k.job_prefix + "running"),
        ("ack", ["finished", finished.token]),
    ]
    assert store.job("q", "finished") == {}
    assert store.job("q", "running")["started"] == started_mark(running.token)

    # The server loses the ack, and keeps what was written before it.
    store.client.restore(k.job_prefix + "finished", 0, row, replace=True)
    store.client.zadd(k.active, {"finished": deadline})
    for scripts, name, keys, args in sent[: [c[1] for c in sent].index("ack")]:
        scripts.run(name, keys, args)
    assert store.job("q", "finished")["started"] == started_mark(finished.token)
    # Its lapse is a stall, past a budget of none (as is the other, running one's).
    lapsed = store.sweep("q", max_stalled=0, now_ms=int(deadline) + 1, max_lapsed=5)
    assert sorted((s.id, s.outcome, s.stalled) for s in lapsed) == [
        ("finished", "dead", 1),
        ("running", "dead", 1),
    ]
    assert "lapsed" not in store.job("q", "finished")


def test_an_ack_that_cannot_be_sent_is_owed_to_the_keeper(
    owed_to: LeaseKeeper, client: redis.Redis, prefix: str
) -> None:
    unreachable = redis.Redis(port=1, socket_connect_timeout=0.5)
    down = JobStore(unreachable, prefix + "emq", lease_ms=5000)
    b = deferring(60_000)
    claims = [Claim(down, "q", "a", 1), Claim(down, "q", "b", 1)]
    b.ack(claims)
    b.start(Claim(down, "q", "c", 1))
    b.flush()  # a start that fails is only logged: the task runs all the same
    assert owed_to.owed_count() == 2
    assert owed_to.get("a#1") == claims[0] and owed_to.get("c#1") is None


def test_one_queue_whose_ack_fails_leaves_the_others_acked(
    owed_to: LeaseKeeper, store: JobStore
) -> None:
    b = deferring(60_000)
    [good] = claims_of(store, "good", ["g"])
    [bad] = claims_of(store, "bad", ["x"])
    # A foreign writer broke one queue's key: its ack script errors (WRONGTYPE).
    store.client.delete(store.keys("bad").active)
    store.client.set(store.keys("bad").active, "not a zset")
    b.ack([good])
    b.ack([bad])
    b.flush()
    assert store.job("good", "g") == {}
    assert owed_to.owed_count() == 1
    assert owed_to.get(f"x#{bad.token}") == bad


def test_a_script_the_server_lost_is_loaded_and_run(store: JobStore) -> None:
    own = JobStore(store.client, store.prefix, store.lease_ms)
    own.scripts.registered["ack"].sha = "0" * 40  # as if the server had no such script
    [claim] = claims_of(own, "q", ["a"])
    batch = own.scripts.batch()
    handle = batch.ack(own.keys("q"), [(claim.job_id, claim.token)])
    batch.execute()
    assert batch.result(handle) == [Outcome.OK]
    assert own.job("q", "a") == {}


@pytest.fixture
def worker_batcher() -> Iterator[SettleBatcher]:
    """The process-wide batcher, deferring as in a ready worker; restored afterwards."""
    b = settle.batcher()
    b.flush()
    saved = (b.delay_ms, b.deferring)
    b.deferring = True
    yield b
    b.flush()
    b.delay_ms, b.deferring = saved


def test_closing_a_channel_sends_its_queued_acks(
    worker_batcher: SettleBatcher, redis_url: str, prefix: str, store: JobStore
) -> None:
    from kombu import Connection

    import celery_emq  # noqa: F401  (registers emq://)

    conn = Connection(
        redis_url.replace("redis://", "emq://", 1),
        transport_options={"global_keyprefix": prefix, "settle_delay_ms": 50},
    )
    with conn:
        q = conn.SimpleQueue("q")
        q.put("a")
        message = q.get(timeout=5)
        worker_batcher.delay_ms = 60_000  # as if the delay were long
        message.ack()
        assert store.counts("q")["active"] == 1
        q.close()
    assert store.counts("q") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert worker_batcher.queued() == 0


def test_queued_settles_are_sent_at_exit(redis_url: str, prefix: str, store: JobStore) -> None:
    [claim] = claims_of(store, "q", ["a"])
    code = textwrap.dedent(
        f"""
        import redis
        from celery_emq.transport.lease import Claim
        from celery_emq.transport.settle import batcher
        from celery_emq.store.jobstore import JobStore

        store = JobStore(redis.Redis.from_url({redis_url!r}), {store.prefix!r}, 5000)
        b = batcher()
        b.delay_ms, b.deferring = 60_000, True
        b.ack([Claim(store, "q", "a", {claim.token!r})])
        assert b.queued() == 1
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert store.job("q", "a") == {}


class _FlushFirst:
    """A lock that lets another thread flush just before it is first taken."""

    def __init__(self, lock: Any, flush: Callable[[], None]) -> None:
        self._lock = lock
        self._flush: Callable[[], None] | None = flush

    def __enter__(self) -> Any:
        flush, self._flush = self._flush, None
        if flush is not None:
            t = threading.Thread(target=flush)
            t.start()
            t.join()
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._lock.__exit__(*exc)


def test_an_ack_queued_while_another_thread_flushes_is_not_lost(store: JobStore) -> None:
    # A pool thread queues an ack while the timer thread takes the queue away
    # to send it: the ack must land in the queue the next send takes.
    b = deferring(60_000)
    [claim] = claims_of(store, "q", ["a"])
    b._lock = _FlushFirst(b._lock, b.flush)  # type: ignore[assignment]
    b.ack([claim])
    assert b.queued() == 1
    b.flush()
    assert store.job("q", "a") == {}


def test_acks_on_their_way_still_count_as_waiting(
    store: JobStore, owed_to: LeaseKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An ack taken by a send still under way is still waiting: a flush (as
    # before a suspect is delivered) returns only once it is sent.
    b = deferring(60_000)
    [claim] = claims_of(store, "q", ["a"])
    [tag] = owed_to.hold(store, "q", [(claim.job_id, claim.token)], 10_000)
    assert b.queued() == 0
    b.ack_tags([tag])
    assert owed_to.held_count() == 0 and b.queued() == 1
    in_send, go_on = threading.Event(), threading.Event()
    send = b._send

    def slow_send(acks: list[Claim], starts: list[Claim], receipts: Any = ()) -> None:
        in_send.set()
        go_on.wait(ROUND_TRIP_WAIT_S)
        send(acks, starts, receipts)

    monkeypatch.setattr(b, "_send", slow_send)
    sender = threading.Thread(target=b.flush)
    sender.start()
    try:
        assert in_send.wait(ROUND_TRIP_WAIT_S)
        assert b._acks == {} and b.queued() == 1
    finally:
        go_on.set()
        sender.join(ROUND_TRIP_WAIT_S)
    assert b.queued() == 0
    assert store.job("q", "a") == {}


def test_an_ack_leaves_the_keeper_and_joins_the_queue_in_one_step(
    store: JobStore, owed_to: LeaseKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read meanwhile from another thread (a pool thread acks while the
    # consumer claims), the claim is never neither held nor waiting.
    b = deferring(60_000)
    [claim] = claims_of(store, "q", ["a"])
    [tag] = owed_to.hold(store, "q", [(claim.job_id, claim.token)], 10_000)
    seen: list[tuple[bool, bool]] = []
    forget = owed_to.forget

    def forget_while_read(t: str) -> Claim | None:
        out = forget(t)
        reader = threading.Thread(
            target=lambda: seen.append((owed_to.held_count() == 0, b.queued() > 0))
        )
        reader.start()
        reader.join(0.2)  # it waits for the ack to be queued
        return out

    monkeypatch.setattr(owed_to, "forget", forget_while_read)
    b.ack_tags([tag])
    wait_until(lambda: len(seen) == 1)
    assert seen == [(True, True)]
    b.flush()
    assert store.job("q", "a") == {}


def test_an_ack_whose_cluster_cannot_be_reached_is_owed(
    owed_to: LeaseKeeper, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster no node of which answers raises redis-py's RedisClusterException,
    # which is no RedisError: the acks must be owed, not dropped.
    down = JobStore(redis.Redis(port=1), prefix + "emq", lease_ms=5000)

    def unreachable(self: Batch, confirm: Any = None) -> None:
        raise redis.exceptions.RedisClusterException("Redis Cluster cannot be connected")

    monkeypatch.setattr(Batch, "execute", unreachable)
    b = deferring(60_000)
    claims = [Claim(down, "q", "a", 1)]
    b.ack(claims)
    b.flush()
    assert owed_to.owed_count() == 1 and owed_to.get("a#1") == claims[0]


def test_a_cluster_that_cannot_be_reached_is_a_connection_error() -> None:
    from celery_emq.store.scripts import Scripts

    class Unreachable:
        def register_script(self, source: str) -> Any:
            return type("S", (), {"sha": "x"})()

        def evalsha(self, *args: Any) -> Any:
            raise redis.exceptions.RedisClusterException("Redis Cluster cannot be connected")

    with pytest.raises(redis.ConnectionError, match="cannot be connected"):
        Scripts(Unreachable()).run("ack", ["k"], [])
    from celery_emq.transport.transport import Transport

    assert issubclass(redis.exceptions.RedisClusterException, Transport.connection_errors)
