"""A queue's state at a glance, for ``celery emq status`` and monitoring."""

from __future__ import annotations

import json
from typing import Any

from .store import JobStore

__all__ = ["queue_status"]

#: Most active or pending rows read to compute ages and the delayed count.
SAMPLE = 1000


def queue_status(store: JobStore, queue: str, now_ms: int | None = None) -> dict[str, Any]:
    """Return counts, lanes, ages and counters of one queue.

    ``delayed`` counts active jobs whose task has an ETA still in the future
    (a worker holds them leased until then). Ages are read from at most
    ``SAMPLE`` rows each: the longest-held leases and the jobs next in line.
    """
    now = store.server_ms() if now_ms is None else now_ms
    k = store.keys(queue)
    counts = store.counts(queue)
    lanes = store.lanes(queue)
    client = store.client
    active_ids = client.zrange(k.active, 0, SAMPLE - 1)
    heads = client.zrange(k.pending, 0, SAMPLE - 1)
    for group in lanes:
        heads += client.zrange(k.lane(group), 0, 0)
    with client.pipeline(transaction=False) as pipe:
        for job_id in active_ids:
            pipe.hmget(k.job(job_id.decode()), "claimed_ms", "payload")
        for job_id in heads:
            pipe.hget(k.job(job_id.decode()), "enqueued_ms")
        replies = pipe.execute()
    active_rows, pending_rows = replies[: len(active_ids)], replies[len(active_ids) :]
    claimed = [int(r[0]) for r in active_rows if r[0]]
    delayed = sum(1 for r in active_rows if r[1] and _eta_ms(r[1]) > now)
    enqueued = [int(v) for v in pending_rows if v]
    return {
        "queue": queue,
        **counts,
        "delayed": delayed,
        "lanes": lanes,
        "oldest_lease_age_ms": now - min(claimed) if claimed else None,
        "oldest_pending_age_ms": now - min(enqueued) if enqueued else None,
        "counters": store.metrics(queue),
    }


def _eta_ms(payload: bytes) -> int:
    try:
        eta = json.loads(payload).get("headers", {}).get("eta")
    except (ValueError, AttributeError):
        return 0
    if not eta:
        return 0
    from datetime import datetime

    try:
        return int(datetime.fromisoformat(eta).timestamp() * 1000)
    except (TypeError, ValueError):
        return 0
