from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome


def test_enqueue_writes_row_pending_and_marker(store: JobStore, client: redis.Redis) -> None:
    assert store.enqueue("q", "a", b'{"x":1}', priority=3, now_ms=1000) is Outcome.OK
    k = store.keys("q")
    assert client.zrange(k.pending, 0, -1) == [b"a"]
    assert client.llen(k.wake) == 1
    row = store.job("q", "a")
    assert row["payload"] == '{"x":1}'
    assert row["state"] == "pending"
    assert row["priority"] == "3"
    assert row["stalled"] == "0"
    assert row["deliveries"] == "0"
    assert row["enqueued_ms"] == "1000"
    assert row["queue"] == "q"


def test_enqueue_duplicate_id_changes_nothing(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"first", now_ms=1)
    assert store.enqueue("q", "a", b"second", now_ms=2) is Outcome.DUPLICATE
    assert store.job("q", "a")["payload"] == "first"
    assert client.zcard(store.keys("q").pending) == 1
    assert client.llen(store.keys("q").wake) == 1


def test_enqueue_with_ttl_marks_the_queue_in_use_and_never_expires_a_row(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}", ttl_ms=10_000, now_ms=1)
    k = store.keys("q")
    assert 0 < client.pttl(k.expires) <= 10_000
    # The queue expires as a whole once unused, never a row or an index on its own.
    for key in (k.pending, k.wake, k.seq, k.job("a")):
        assert client.pttl(key) == -1, key


def test_enqueue_without_ttl_writes_no_expires_key(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    assert not client.exists(store.keys("q").expires)


def test_keys_share_the_queue_hash_tag(store: JobStore) -> None:
    k = store.keys("my.queue")
    for key in (k.pending, k.active, k.dead, k.wake, k.seq, k.head, k.expires, k.job("x")):
        assert "{my.queue}" in key
