"""A queue's state at a glance, for ``celery emq status`` and monitoring."""

from __future__ import annotations

from typing import Any

from .store import JobStore

__all__ = ["queue_status"]

#: Most rows read to compute each age: the longest-held leases, the jobs next in
#: line in the default lane, and the heads of the first lanes.
SAMPLE = 1000


def queue_status(store: JobStore, queue: str, now_ms: int | None = None) -> dict[str, Any]:
    """Return counts, lanes, ages and counters of one queue, in a fixed number of round trips.

    ``delayed`` counts the jobs whose ETA is still ahead: they wait in the
    broker, not in a worker. Ages are read from at most ``SAMPLE`` rows each.
    """
    k = store.keys(queue)
    client = store.client
    with client.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.zcard(k.pending).zcard(k.active).zcard(k.delayed).zcard(k.dead)
        pipe.zrange(k.lanes, 0, -1)
        pipe.zrange(k.active, 0, SAMPLE - 1)
        pipe.zrange(k.pending, 0, SAMPLE - 1)
        (secs, micros), pending, active, delayed, dead, groups, active_ids, heads = pipe.execute()
    now = int(secs) * 1000 + int(micros) // 1000 if now_ms is None else now_ms
    names = [g.decode() if isinstance(g, bytes) else g for g in groups]
    lanes: dict[str, int] = {}
    if names:
        with client.pipeline(transaction=False) as pipe:
            for g in names:
                pipe.zcard(k.lane(g))
            for g in names[:SAMPLE]:
                pipe.zrange(k.lane(g), 0, 0)
            replies = pipe.execute()
        lanes = {g: int(n) for g, n in zip(names, replies[: len(names)], strict=True) if n}
        for head in replies[len(names) :]:
            heads += head
    with client.pipeline(transaction=False) as pipe:
        for job_id in active_ids:
            pipe.hget(k.job(job_id.decode()), "claimed_ms")
        for job_id in heads:
            pipe.hget(k.job(job_id.decode()), "enqueued_ms")
        replies = pipe.execute()
    claimed = [int(v) for v in replies[: len(active_ids)] if v]
    enqueued = [int(v) for v in replies[len(active_ids) :] if v]
    return {
        "queue": queue,
        "pending": int(pending) + sum(lanes.values()),
        "active": int(active),
        "delayed": int(delayed),
        "dead": int(dead),
        "lanes": lanes,
        "oldest_lease_age_ms": now - min(claimed) if claimed else None,
        "oldest_pending_age_ms": now - min(enqueued) if enqueued else None,
        "counters": store.metrics(queue),
    }
