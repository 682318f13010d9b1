"""Queues' state at a glance, for ``celery emq status``, the metrics and the morgue page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.cluster import RedisCluster

from celery_emq.store.jobstore import METRICS, JobStore

__all__ = ["queue_status", "queue_statuses"]

#: The counters that also count by reason (field ``reason:<reason>``).
BY_REASON: tuple[str, ...] = ("recovered", "stalled", "failed")


def queue_status(store: JobStore, queue: str, now_ms: int | None = None) -> dict[str, Any]:
    """Return counts, lanes, ages and counters of one queue (see :func:`queue_statuses`)."""
    return queue_statuses(store, [queue], now_ms)[0]


def queue_statuses(
    store: JobStore, queues: Sequence[str], now_ms: int | None = None
) -> list[dict[str, Any]]:
    """Return counts, lanes, ages and counters of each queue, in two round trips in all.

    ``delayed`` counts the jobs whose ETA is still ahead: they wait in the
    broker, not in a worker. ``oldest_pending_age_ms`` is the age of the
    pending job enqueued first, whatever its priority or lane;
    ``oldest_lease_age_ms`` the time since the earliest claim still held (see
    :meth:`JobStore.gauges`, which reads more only for a queue past a page of
    lanes or active jobs). ``counters`` are the queue's totals; ``reasons``
    splits ``recovered``, ``stalled`` and ``failed`` by reason, a part counted
    before reasons were kept showing as ``unknown``.
    """
    if not queues:
        return []
    client = store.client
    gauges = store.gauges(queues)
    clustered = isinstance(client, RedisCluster)
    with client.pipeline(transaction=False) as pipe:
        if not clustered:
            pipe.time()
        for q in queues:
            k = store.keys(q)
            for name in METRICS:
                pipe.hgetall(k.metrics(name))
            pipe.hgetall(k.metrics("fenced"))
        replies = pipe.execute()
    if clustered:
        # A cluster pipeline carries keyed commands only: the clock of the
        # master serving the first queue (the one its scripts read) is asked apart.
        first = store.keys(queues[0]).active
        secs, micros = client.get_redis_connection(client.get_node_from_key(first)).time()
    else:
        (secs, micros), *replies = replies
    now = int(secs) * 1000 + int(micros) // 1000 if now_ms is None else now_ms
    per_queue = len(METRICS) + 1
    out = []
    for i, (q, (counts, lanes, enqueued, claimed)) in enumerate(zip(queues, gauges, strict=True)):
        hashes = [
            {f.decode(): int(v) for f, v in h.items()}
            for h in replies[i * per_queue : (i + 1) * per_queue]
        ]
        fenced = hashes.pop()
        counters = {name: h.get("count", 0) for name, h in zip(METRICS, hashes, strict=True)}
        reasons: dict[str, dict[str, int]] = {}
        for name, h in zip(METRICS, hashes, strict=True):
            if name not in BY_REASON:
                continue
            split = {f[len("reason:") :]: n for f, n in h.items() if f.startswith("reason:")}
            rest = counters[name] - sum(split.values())
            if rest > 0:
                split["unknown"] = rest
            reasons[name] = split
        out.append(
            {
                "queue": q,
                "pending": counts["pending"],
                "active": counts["active"],
                "delayed": counts["delayed"],
                "dead": counts["dead"],
                "lanes": lanes,
                "oldest_lease_age_ms": None if claimed is None else now - claimed,
                "oldest_pending_age_ms": None if enqueued is None else now - enqueued,
                "counters": counters,
                "reasons": reasons,
                # Settles that named a claim other than the live one, by verb.
                "fenced": {
                    f[len("reason:") :]: n for f, n in fenced.items() if f.startswith("reason:")
                },
            }
        )
    return out
