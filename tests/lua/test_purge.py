from __future__ import annotations

import redis

from celery_emq.store.base import PURGE_BATCH
from celery_emq.store.jobstore import JobStore
from tests.conftest import bulk_enqueue


def test_purge_deletes_pending_jobs_in_batches(store: JobStore, client: redis.Redis) -> None:
    n = PURGE_BATCH + 250
    k = store.keys("q")
    bulk_enqueue(store, "q", n)
    store.claim("q", "w", count=1, now_ms=1)  # one active job stays
    assert store.purge("q") == n - 1
    assert client.zcard(k.pending) == 0
    assert not client.exists(k.wake, k.seq)
    assert client.zcard(k.active) == 1
    assert client.exists(k.job("0"))
    assert not client.exists(k.job("1"))
