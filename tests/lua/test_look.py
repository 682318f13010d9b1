"""look.lua: one call over a server's queues says which need a sweep pass."""

from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore

LEASE_MS = 10_000


def _store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", LEASE_MS)


def test_an_idle_queue_needs_no_pass_and_is_recorded_swept(
    client: redis.Redis, prefix: str
) -> None:
    store = _store(client, prefix)
    looked = store.look(["a", "b"], ["9000", "9000"], now_ms=10_000)
    assert (looked.now_ms, looked.needs) == (10_000, [False, False])
    for q in ("a", "b"):
        swept = store.keys(q).base + "swept"
        assert client.hget(swept, "at") == b"10000"
        assert 0 < client.pttl(swept) <= 86_400_000


def test_each_kind_of_work_asks_for_its_queues_pass(client: redis.Redis, prefix: str) -> None:
    store = _store(client, prefix)
    # A lease lapsed.
    store.enqueue("lapsed", "j", b"{}", now_ms=0)
    store.claim("lapsed", "w", now_ms=0)
    # A delayed job due.
    store.enqueue("due", "j", b"{}", now_ms=0, eta_ms=9_500)
    # Claimable jobs whose wake marker was lost.
    store.enqueue("stranded", "j", b"{}", now_ms=9_000)
    client.delete(store.keys("stranded").wake)
    # Jobs waiting with their marker, a lease live, a delayed job not yet due: idle.
    store.enqueue("waiting", "j", b"{}", now_ms=9_000)
    store.enqueue("live", "j", b"{}", now_ms=9_000)
    store.claim("live", "w", now_ms=9_000)
    store.enqueue("later", "j", b"{}", now_ms=0, eta_ms=60_000)
    # Ordering keys left over with nothing pending.
    client.set(store.keys("leftover").seq, 5)
    queues = ["lapsed", "due", "stranded", "waiting", "live", "later", "leftover"]
    looked = store.look(queues, ["9500"] * len(queues), now_ms=10_000)
    assert dict(zip(queues, looked.needs, strict=True)) == {
        "lapsed": True,
        "due": True,
        "stranded": True,
        "waiting": False,
        "live": False,
        "later": False,
        "leftover": True,
    }
    # Those that need a pass are left for it to record.
    assert client.hget(store.keys("lapsed").base + "swept", "at") is None


def test_the_morgue_past_its_retention_asks_for_a_pass(client: redis.Redis, prefix: str) -> None:
    store = _store(client, prefix)
    dead = store.keys("q").dead
    client.zadd(dead, {"old": 1_000, "new": 9_000})
    assert store.look(["q"], ["9500"], now_ms=10_000).needs == [False]
    assert store.look(["q"], ["9500"], now_ms=10_000, dead_max_age_ms=5_000).needs == [True]
    assert store.look(["q"], ["9500"], now_ms=10_000, dead_max_size=1).needs == [True]
    assert store.look(["q"], ["9500"], now_ms=10_000, dead_max_size=2).needs == [False]


def test_no_recent_pass_of_the_callers_own_leaves_the_verdict_to_the_sweep(
    client: redis.Redis, prefix: str
) -> None:
    # The outage rule needs the sweep: a caller with no pass, one that failed, one
    # cut off for over half a lease, or a record older than the caller's pass.
    store = _store(client, prefix)
    since = ["", "0", str(10_000 - LEASE_MS // 2 - 1), "9000"]
    queues = ["none", "failed", "gap", "recent"]
    assert store.look(queues, since, now_ms=10_000).needs == [True, True, True, False]
    client.hset(store.keys("rolled").base + "swept", "at", 8_000)
    assert store.look(["rolled"], ["9000"], now_ms=10_000).needs == [True]


def test_the_look_counts_the_x_expires_registry(client: redis.Redis, prefix: str) -> None:
    store = _store(client, prefix)
    assert store.look(["q"], ["9500"], now_ms=10_000).expiring == 0
    client.sadd(store.expiring_key, "x1", "x2")
    assert store.look(["q"], ["9500"], now_ms=10_000).expiring == 2


def test_one_promote_call_scans_every_queue_of_one_server(client: redis.Redis, prefix: str) -> None:
    store = _store(client, prefix)
    now = store.server_ms()
    store.enqueue("a", "due", b"{}", now_ms=now - 1000, eta_ms=now - 10)
    store.enqueue("b", "later", b"{}", eta_ms=now + 60_000)
    store.enqueue("c", "ready", b"{}")
    found = store.scripts.promote_many([store.keys(q) for q in ("a", "b", "c", "d")], 10)
    assert [(n, waiting) for n, waiting, _ in found] == [
        (1, True),
        (0, False),
        (0, True),
        (0, False),
    ]
    assert 0 < found[1][2] <= 60_000 and found[0][2] == -1 and found[3][2] == -1
    scan = store.scan(["a", "b", "c", "d"])
    assert scan.waiting == ["a", "c"] and scan.next_due_ms is not None
