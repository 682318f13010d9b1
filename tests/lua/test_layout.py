"""A job's row holds only small fields (a compact listpack); its message has a key of its own."""

from __future__ import annotations

import json

import redis

from celery_emq.store.codec import pack, unpack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from tests.test_codec import MESSAGE

COMPACT = (b"listpack", b"ziplist")


def test_a_queued_job_is_a_small_row_and_a_compressed_message(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    store.enqueue("q", "a", MESSAGE, now_ms=1000)
    assert client.hgetall(k.job("a")) == {b"state": b"pending", b"enqueued_ms": b"1000"}
    # The compact encoding: listpack since Redis 7, ziplist before.
    assert client.object("encoding", k.job("a")) in COMPACT
    stored = client.get(k.msg("a"))
    assert stored == pack(MESSAGE) and len(stored) < len(MESSAGE) / 3
    [job] = store.claim("q", "worker-1", now_ms=1001)
    assert unpack(job.payload) == MESSAGE.encode()
    # An active row stays compact too.
    assert client.object("encoding", k.job("a")) in COMPACT
    assert store.ack("q", "a", job.token) is Outcome.OK
    assert not client.exists(k.job("a"), k.msg("a"))


def test_a_row_written_by_an_earlier_version_is_claimed_settled_and_buried(
    store: JobStore, client: redis.Redis
) -> None:
    # Rows of the earlier layout held the message and every counter in the row.
    k = store.keys("q")
    for job_id in ("old1", "old2"):
        client.hset(
            k.job(job_id),
            mapping={
                "payload": MESSAGE,
                "queue": "q",
                "state": "pending",
                "priority": 0,
                "stalled": 0,
                "deliveries": 0,
                "enqueued_ms": 1,
            },
        )
        client.zadd(k.pending, {job_id: int(client.incr(k.seq))})
        client.lpush(k.wake, 1)
    first, second = store.claim("q", "w", count=2, now_ms=10)
    assert (first.id, first.payload) == ("old1", MESSAGE.encode())
    assert store.ack("q", "old1", first.token) is Outcome.OK
    assert not client.exists(k.job("old1"))
    # A lapsed, started claim of the old layout is dead-lettered with its message.
    store.start("q", "old2", second.token)
    [swept] = store.sweep("q", max_stalled=0, now_ms=10 + store.lease_ms + 1)
    assert (swept.outcome, swept.payload) == ("dead", MESSAGE.encode())
    assert json.loads(store.job("q", "old2")["payload"])["headers"]["task"] == "proj.tasks.add"
