"""A publish batch's Redis part, two ways: a pipeline of ``enqueue`` calls or ``enqueue_many``.

    python -m bench.publish_batch --jobs 1000 --rounds 5

Stores ``--jobs`` jobs (a typical Celery task message, stored compressed) in one
round trip each way, alternating which goes first, and prints per way the
median jobs a second the client saw and the Redis server's CPU per job (its
``commandstats`` microseconds for ``EVALSHA``), on a private ``redis-server``
(its statistics are reset every round).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import redis

from bench._common import private_redis, scan_delete
from celery_emq.store.codec import pack
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import NewJob

#: A Celery task message as ``emq://`` stores it (JSON text, 930 bytes).
MESSAGE = (
    b'{"body": "W1tdLCB7fSwgeyJjYWxsYmFja3MiOiBudWxsLCAiZXJyYmFja3MiOiBudWxsLCAiY2hhaW4iOiBudWxs'
    b'LCAiY2hvcmQiOiBudWxsfV0=", "content-encoding": "utf-8", "content-type": "application/json", '
    b'"headers": {"lang": "py", "task": "bench.app.noop", "id": "%s", "shadow": null, '
    b'"eta": null, "expires": null, "group": null, "group_index": null, "retries": 0, '
    b'"timelimit": [null, null], "root_id": "%s", "parent_id": null, "argsrepr": "()", '
    b'"kwargsrepr": "{}", "origin": "gen1234@bench", "ignore_result": true, '
    b'"replaced_task_nesting": 0, "stamped_headers": null, "stamps": {}}, "properties": '
    b'{"correlation_id": "%s", "reply_to": "", "delivery_mode": 2, "delivery_info": '
    b'{"exchange": "", "routing_key": "celery"}, "priority": 0, "body_encoding": "base64"}}'
)


def jobs(n: int) -> list[NewJob]:
    out = []
    for _ in range(n):
        tid = str(uuid.uuid4()).encode()
        out.append(NewJob(uuid.uuid4().hex, MESSAGE % (tid, tid, tid)))
    return out


def pipelined(store: JobStore, queue: str, batch: list[NewJob]) -> None:
    """One ``enqueue`` call per job, all in one pipeline."""
    b = store.scripts.batch()
    k = store.keys(queue)
    for job in batch:
        b.enqueue(k, job.id, pack(job.payload), job.priority, None)
    b.execute()


def many(store: JobStore, queue: str, batch: list[NewJob]) -> None:
    """One ``enqueue_many`` call per 500 jobs, all in one pipeline."""
    b = store.scripts.batch()
    store.queue_enqueue_many(b, queue, batch)
    b.execute()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with private_redis() as url:
        run(redis.Redis.from_url(url), args.jobs, args.rounds)


def run(client: redis.Redis, n: int, rounds: int) -> None:
    prefix = f"benchpb{uuid.uuid4().hex[:8]}:"
    store = JobStore(client, prefix + "emq", 30_000)
    ways = {"pipeline of enqueue": pipelined, "enqueue_many": many}
    rates: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for r in range(rounds + 1):
            order = list(ways) if r % 2 else list(reversed(ways))
            for way in order:
                batch = jobs(n)
                client.config_resetstat()
                t0 = time.perf_counter()
                ways[way](store, f"q{r}", batch)
                elapsed = time.perf_counter() - t0
                stats = client.info("commandstats")
                usec = sum(
                    int(stats[name]["usec"])
                    for name in ("cmdstat_evalsha", "cmdstat_eval")
                    if name in stats
                )
                if r:  # the first round loads the scripts
                    rates[way].append(n / elapsed)
                    cpu[way].append(usec / n)
                scan_delete(client, prefix)
    finally:
        scan_delete(client, prefix)
    for way in ways:
        print(
            f"{way:>20}: {statistics.median(rates[way]):8.0f} jobs/s, "
            f"server {statistics.median(cpu[way]):5.1f} us/job"
        )


if __name__ == "__main__":
    main()
