from __future__ import annotations

import redis

from celery_emq.scripts import Outcome
from celery_emq.store import JobStore


def test_ack_deletes_row_and_lease(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "w", now_ms=2)
    assert store.ack("q", "a", "w") is Outcome.OK
    k = store.keys("q")
    assert client.zcard(k.active) == 0
    assert not client.exists(k.job("a"))


def test_ack_unknown_job_is_not_found(store: JobStore) -> None:
    assert store.ack("q", "nope", "w") is Outcome.NOT_FOUND


def test_ack_by_another_owner_reports_lease_lost_and_still_deletes(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "w2", now_ms=2)
    assert store.ack("q", "a", "w1") is Outcome.LEASE_LOST
    assert not client.exists(store.keys("q").job("a"))
    assert client.zcard(store.keys("q").active) == 0


def test_ack_of_a_dead_job_keeps_it_in_the_morgue(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "w", now_ms=2)
    store.bury("q", "a", "malformed", "bad json", now_ms=3)
    assert store.ack("q", "a", "w") is Outcome.DEAD
    assert client.zscore(store.keys("q").dead, "a") == 3
