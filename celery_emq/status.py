"""A queue's state at a glance, for ``celery emq status`` and monitoring."""

from __future__ import annotations

from typing import Any

from redis.cluster import RedisCluster

from .store import JobStore

__all__ = ["queue_status"]

#: Most rows read to compute each age: the longest-held leases and the jobs next
#: in line in the default lane (each lane's next job is read by the tally).
SAMPLE = 1000


def queue_status(store: JobStore, queue: str, now_ms: int | None = None) -> dict[str, Any]:
    """Return counts, lanes, ages and counters of one queue, in a fixed number of round trips.

    ``delayed`` counts the jobs whose ETA is still ahead: they wait in the
    broker, not in a worker. Ages are read from at most ``SAMPLE`` rows each
    (and the next job of every lane).
    """
    k = store.keys(queue)
    client = store.client
    counts, lanes, heads = store.tally(queue, heads=True)
    clustered = isinstance(client, RedisCluster)
    with client.pipeline(transaction=False) as pipe:
        if not clustered:
            pipe.time()
        pipe.zrange(k.active, 0, SAMPLE - 1)
        pipe.zrange(k.pending, 0, SAMPLE - 1)
        *clock, active_ids, pending_ids = pipe.execute()
    if clustered:
        # A cluster pipeline carries keyed commands only: the clock of the
        # master serving the queue (the one its scripts read) is asked apart.
        clock = [client.get_redis_connection(client.get_node_from_key(k.active)).time()]
    secs, micros = clock[0]
    now = int(secs) * 1000 + int(micros) // 1000 if now_ms is None else now_ms
    with client.pipeline(transaction=False) as pipe:
        for job_id in active_ids:
            pipe.hget(k.job(job_id.decode()), "claimed_ms")
        for job_id in pending_ids:
            pipe.hget(k.job(job_id.decode()), "enqueued_ms")
        replies = pipe.execute()
    claimed = [int(v) for v in replies[: len(active_ids)] if v]
    enqueued = [int(v) for v in replies[len(active_ids) :] if v] + heads
    return {
        "queue": queue,
        "pending": counts["pending"],
        "active": counts["active"],
        "delayed": counts["delayed"],
        "dead": counts["dead"],
        "lanes": lanes,
        "oldest_lease_age_ms": now - min(claimed) if claimed else None,
        "oldest_pending_age_ms": now - min(enqueued) if enqueued else None,
        "counters": store.metrics(queue),
    }
