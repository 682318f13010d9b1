from __future__ import annotations

import redis

from celery_emq.store import PURGE_BATCH, JobStore


def test_purge_deletes_pending_jobs_in_batches(store: JobStore, client: redis.Redis) -> None:
    n = PURGE_BATCH + 250
    k = store.keys("q")
    with client.pipeline() as pipe:
        for i in range(n):
            store.scripts._scripts["enqueue"](
                keys=[k.pending, k.wake, k.seq, k.job(str(i))],
                args=[str(i), b"{}", "q", 0, 1, 0],
                client=pipe,
            )
        pipe.execute()
    store.claim("q", "w", count=1, now_ms=1)  # one active job stays
    assert store.purge("q") == n - 1
    assert client.zcard(k.pending) == 0
    assert not client.exists(k.wake, k.seq)
    assert client.zcard(k.active) == 1
    assert client.exists(k.job("0"))
    assert not client.exists(k.job("1"))
