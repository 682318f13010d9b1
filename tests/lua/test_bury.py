from __future__ import annotations

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome


def test_bury_moves_job_to_morgue_with_reason(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"not json", now_ms=1)
    [job] = store.claim("q", "w", now_ms=2)
    assert store.bury("q", "a", job.token, "malformed", "JSONDecodeError", now_ms=5) is (Outcome.OK)
    k = store.keys("q")
    assert client.zcard(k.active) == 0
    assert client.zscore(k.dead, "a") == 5
    row = store.job("q", "a")
    assert row["state"] == "dead"
    assert row["last_error"] == "malformed"
    assert row["error"] == "JSONDecodeError"
    assert row["died_ms"] == "5"
    assert row["payload"] == "not json"
    assert client.hget(k.metrics("failed"), "count") == b"1"


def test_bury_twice_is_not_found(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    # A pending job carries no live claim: the verdict is on the message.
    assert store.bury("q", "a", 0, "rejected", "", now_ms=2) is Outcome.OK
    assert store.bury("q", "a", 0, "rejected", "", now_ms=3) is Outcome.NOT_FOUND
    k = store.keys("q")
    assert client.zscore(k.dead, "a") == 2
    assert client.llen(k.wake) == 0
    assert client.hget(k.metrics("failed"), "count") == b"1"
