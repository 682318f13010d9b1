"""enqueue_many.lua: many jobs in one call, each as enqueue.lua would store it."""

from __future__ import annotations

from typing import Any

import redis

from celery_emq.store.calls import ENQUEUE_BATCH
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import UNSET, NewJob, Outcome

#: A plain job, prioritised ones, one with its own budget, grouped ones (two
#: groups), a delayed one with a task id and one whose ETA has passed.
JOBS = [
    NewJob("a", b'{"n": 1}'),
    NewJob("b", b'{"n": 2}', priority=3),
    NewJob("c", b'{"n": 3}', max_stalled=2),
    NewJob("d", b'{"n": 4}', max_stalled=None, group="g1"),
    NewJob("e", b'{"n": 5}', priority=9, group="g2"),
    NewJob("f", b'{"n": 6}', group="g1"),
    NewJob("g", b'{"n": 7}', eta_ms=50_000, task_id="t-g"),
    NewJob("h", b'{"n": 8}', eta_ms=500),
    NewJob("i", b'{"n": 9}' * 40),
]


def state(client: redis.Redis, store: JobStore, queue: str) -> dict[str, Any]:
    """Every key of a queue, keyed by its name less the queue's prefix."""
    base = store.keys(queue).base
    out: dict[str, Any] = {}
    for key in client.scan_iter(match=base + "*", count=1000):
        name = key.decode()[len(base) :]
        kind = client.type(key).decode()
        if kind == "zset":
            out[name] = client.zrange(key, 0, -1, withscores=True)
        elif kind == "hash":
            out[name] = client.hgetall(key)
        elif kind == "list":
            out[name] = client.lrange(key, 0, -1)
        else:
            out[name] = client.get(key)
    return out


def test_enqueue_many_stores_what_one_enqueue_per_job_stores(
    store: JobStore, client: redis.Redis
) -> None:
    for job in JOBS:
        assert (
            store.enqueue(
                "one",
                job.id,
                job.payload,
                job.priority,
                10_000,
                1000,
                max_stalled=job.max_stalled,
                group=job.group,
                eta_ms=job.eta_ms,
                task_id=job.task_id,
            )
            is Outcome.OK
        )
    assert store.enqueue_many("many", JOBS, ttl_ms=10_000, now_ms=1000) == [Outcome.OK] * 9
    one, many = state(client, store, "one"), state(client, store, "many")
    assert one.pop("expires") == many.pop("expires") == b"1"
    assert one == many
    # The figures themselves: 8 claimable (one marker each), 1 delayed, 2 lanes.
    assert len(many["wake"]) == 8
    assert many["seq"] == b"8"
    assert [m for m, _ in many["delayed"]] == [b"g"]
    assert many["etas"] == {b"t-g": b"g"}
    assert [m for m, _ in many["lanes"]] == [b"g1", b"g2"]
    assert [m for m, _ in many["g:g1:pending"]] == [b"d", b"f"]
    assert many["job:d"][b"max_stalled"] == b"-1"


def test_enqueue_many_continues_the_fifo_sequence_of_single_enqueues(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "x", b"{}", now_ms=1)
    store.enqueue_many("q", [NewJob("y", b"{}"), NewJob("z", b"{}")], now_ms=2)
    store.enqueue("q", "w", b"{}", now_ms=3)
    k = store.keys("q")
    assert client.zrange(k.pending, 0, -1, withscores=True) == [
        (b"x", 1.0),
        (b"y", 2.0),
        (b"z", 3.0),
        (b"w", 4.0),
    ]
    assert client.llen(k.wake) == 4


def test_enqueue_many_duplicates_change_nothing(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"first", now_ms=1)
    jobs = [NewJob("a", b"second"), NewJob("b", b"{}"), NewJob("b", b"again")]
    assert store.enqueue_many("q", jobs, now_ms=2) == [
        Outcome.DUPLICATE,
        Outcome.OK,
        Outcome.DUPLICATE,
    ]
    assert store.job("q", "a")["payload"] == "first"
    assert store.job("q", "b")["payload"] == "{}"
    k = store.keys("q")
    assert client.zcard(k.pending) == 2
    assert client.llen(k.wake) == 2
    # Sent again whole (a replayed flush): nothing changes.
    before = state(client, store, "q")
    assert store.enqueue_many("q", jobs, now_ms=3) == [Outcome.DUPLICATE] * 3
    assert state(client, store, "q") == before


def test_enqueue_many_splits_past_the_call_limit_and_pushes_a_marker_per_job(
    store: JobStore, client: redis.Redis
) -> None:
    n = ENQUEUE_BATCH * 2 + 7
    jobs = [NewJob(f"j{i}", b"{}") for i in range(n)]
    assert store.enqueue_many("q", jobs, now_ms=1) == [Outcome.OK] * n
    k = store.keys("q")
    assert client.llen(k.wake) == n
    assert client.get(k.seq) == str(n).encode()
    assert client.zrange(k.pending, 0, 2) == [b"j0", b"j1", b"j2"]
    assert client.zrange(k.pending, -1, -1) == [f"j{n - 1}".encode()]
    assert store.job("q", f"j{n - 1}")["state"] == "pending"


def test_enqueue_many_writes_no_expires_key_without_a_ttl(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue_many("q", [NewJob("a", b"{}", max_stalled=UNSET)], now_ms=1)
    assert not client.exists(store.keys("q").expires)


def test_one_call_past_the_scripts_own_chunks_stores_what_single_enqueues_store(
    store: JobStore, client: redis.Redis, monkeypatch: Any
) -> None:
    # One script call of more jobs than it writes in one MSET or ZADD (500):
    # each of its chunks lands, in the default queue and in a lane alike.
    monkeypatch.setattr("celery_emq.store.calls.ENQUEUE_BATCH", 5000)
    jobs = [
        NewJob(f"j{i}", b'{"i": %d}' % i, priority=i % 3, group="g" if i % 4 == 0 else "")
        for i in range(1201)
    ]
    for job in jobs:
        store.enqueue("one", job.id, job.payload, job.priority, now_ms=1000, group=job.group)
    assert store.enqueue_many("many", jobs, now_ms=1000) == [Outcome.OK] * len(jobs)
    one, many = state(client, store, "one"), state(client, store, "many")
    assert one == many
    assert len(many["wake"]) == len(jobs)
    assert len(many["pending"]) == 900
    assert len(many["g:g:pending"]) == 301
