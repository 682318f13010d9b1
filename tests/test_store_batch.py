"""A store batch writes each call as it is built, and reads the replies after."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import NewJob, Outcome
from tests.conftest import REDIS_URL, delete_prefix


@pytest.fixture
def one_connection(prefix: str) -> Iterator[redis.Redis]:
    """A client on the plain test Redis that has one connection, reused by every command."""
    pool = redis.BlockingConnectionPool.from_url(REDIS_URL, max_connections=1, timeout=5)
    c = redis.Redis(connection_pool=pool)
    yield c
    delete_prefix(c, prefix)
    c.close()


def test_a_call_runs_on_the_server_before_the_next_is_built(
    store: JobStore, client: redis.Redis
) -> None:
    batch = store.scripts.batch()
    first = store.queue_enqueue_many(batch, "first", [NewJob("a", b'{"n": 1}')])
    seen: list[bool] = []

    def prepare(payload: str | bytes) -> str | bytes:
        # Built only once the first call went out: wait (bounded) until it ran.
        deadline = time.monotonic() + 5
        while not client.exists(store.keys("first").job("a")) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(bool(client.exists(store.keys("first").job("a"))))
        return payload

    second = batch.enqueue_many(store.keys("second"), [NewJob("b", b'{"n": 2}')], None, 0, prepare)
    batch.execute()
    assert seen == [True]
    assert batch.result(first) == [Outcome.OK]
    assert batch.result(second) == [Outcome.OK]
    assert store.job("second", "b")["payload"] == '{"n": 2}'


def test_each_message_is_prepared_once_when_sent_and_chunks_make_calls(
    store: JobStore, client: redis.Redis
) -> None:
    prepared: list[bytes] = []

    def prepare(payload: str | bytes) -> str | bytes:
        assert isinstance(payload, bytes)
        prepared.append(payload)
        return payload.upper()

    jobs = [NewJob(f"j{i}", b'{"i": %d}' % i) for i in range(7)]
    batch = store.scripts.batch()
    handle = batch.enqueue_many(store.keys("q"), jobs, None, 0, prepare, chunk=3)
    assert prepared == []  # nothing is built before the batch is sent
    client.config_resetstat()
    batch.execute()
    assert prepared == [j.payload for j in jobs]
    assert batch.result(handle) == [Outcome.OK] * 7
    assert store.job("q", "j6")["payload"] == '{"I": 6}'
    stats = client.info("commandstats")
    calls = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))
    assert calls == 3  # 3 + 3 + 1 jobs


def test_a_call_that_cannot_be_built_leaves_no_reply_behind_on_the_connection(
    one_connection: redis.Redis, prefix: str
) -> None:
    store = JobStore(one_connection, prefix + "emq", lease_ms=5000)
    store.enqueue("warm", "w", b"{}")  # loads the scripts

    def prepare(payload: str | bytes) -> str | bytes:
        raise RuntimeError("cannot build")

    batch = store.scripts.batch()
    store.queue_enqueue_many(batch, "first", [NewJob("a", b"{}")])
    batch.enqueue_many(store.keys("second"), [NewJob("b", b"{}")], None, 0, prepare)
    with pytest.raises(RuntimeError, match="cannot build"):
        batch.execute()
    # The one connection answers the next command with that command's reply,
    # not with the first call's reply left unread.
    one_connection.set(prefix + "k", "v")
    assert one_connection.get(prefix + "k") == b"v"
    assert store.enqueue("third", "c", b"{}") is Outcome.OK
