from __future__ import annotations

import time

import redis

from celery_emq.lease import LeaseKeeper
from celery_emq.store import JobStore


def test_renew_once_extends_every_held_lease(store: JobStore, client: redis.Redis) -> None:
    for i in ("a", "b", "c"):
        store.enqueue("q", i, b"{}", now_ms=1)
    store.claim("q", "me", count=3, now_ms=1000)
    k = LeaseKeeper("me")
    k.hold(store, "q", ["a", "b", "c"], interval_ms=60_000)
    assert k.renew_once(now_ms=9000) == []
    for i in ("a", "b", "c"):
        assert client.zscore(store.keys("q").active, i) == 9000 + store.lease_ms


def test_lost_lease_is_reported_once_and_not_renewed(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "someone-else", now_ms=1000)
    k = LeaseKeeper("me")
    k.hold(store, "q", ["a"], interval_ms=60_000)
    assert k.renew_once(now_ms=2000) == ["a"]
    assert k.renew_once(now_ms=3000) == []
    assert client.zscore(store.keys("q").active, "a") == 1000 + store.lease_ms
    assert k.forget("a") == (store, "q")
    assert k.held_count() == 0


def test_thread_renews_on_its_own(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "me", now_ms=1)  # deadline far in the past
    k = LeaseKeeper("me")
    k.hold(store, "q", ["a"], interval_ms=100)
    deadline = time.monotonic() + 5
    while k.renewals < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert k.renewals >= 2
    assert client.zscore(store.keys("q").active, "a") > time.time() * 1000
    k.forget("a")
