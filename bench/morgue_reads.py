"""Morgue reads benchmark: what ``dead ls --limit 5`` and ``dead show`` cost as the morgue grows.

Buries ``--small`` and then ``--large`` dead jobs (400 and 40,000 by default) spread over
``--queues`` queues under a private key prefix of the Redis you name, and times the reads
``celery emq dead ls --limit 5`` and ``dead show JOB_ID`` make (:meth:`Morgue.ls` and
:meth:`Morgue.show`), ``--runs`` times each (median). Reports both times at both sizes and
the ratio large/small: a read bounded by what it shows stays within a small factor. The
keys are deleted afterwards (SCAN, never FLUSH*). No worker runs: the jobs are buried by
the store's own scripts.

    python bench/morgue_reads.py --port 6379 --db 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import add_redis_options, scan_delete
from celery_emq.ops.morgue import Morgue
from celery_emq.store.calls import time_arg
from celery_emq.store.jobstore import JobStore

BODY = json.dumps([[1], {}, {}]).encode()


def bury_many(store: JobStore, queues: list[str], n: int) -> str:
    """Bury ``n`` dead jobs round-robin over ``queues``; return one of their ids."""
    bury = store.scripts.registered["bury"]
    for start in range(0, n, 1000):
        with store.client.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 1000)):
                q = queues[i % len(queues)]
                k = store.keys(q)
                job_id = f"j{i:06d}"
                store.scripts.enqueue(k, job_id, BODY, 0, None, client=pipe)
                bury(
                    keys=[
                        *(k.active, k.pending, k.wake, k.dead, k.job(job_id)),
                        *(k.metrics("failed"), k.base),
                    ],
                    args=[job_id, "0", "malformed", "bench", time_arg(1_000_000 + i)],
                    client=pipe,
                )
            pipe.execute()
    for q in queues:
        store.register(q)
    return f"j{n // 2:06d}"


def median_s(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(client: redis.Redis, n: int, queues: int, runs: int) -> dict[str, float]:
    prefix = f"bench-morgue-{uuid.uuid4().hex[:8]}:"
    store = JobStore(client, prefix + "emq", 5000)
    try:
        names = [f"q{i}" for i in range(queues)]
        some = bury_many(store, names, n)
        assert store.counts(names[0])["dead"] == n // queues
        morgue = Morgue(store)
        assert len(morgue.ls(limit=5)) == 5
        assert morgue.show(some) is not None
        return {
            "dead": n,
            "ls_limit_5_s": median_s(lambda: morgue.ls(limit=5), runs),
            "show_s": median_s(lambda: morgue.show(some), runs),
        }
    finally:
        scan_delete(client, prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_redis_options(ap)
    ap.add_argument("--small", type=int, default=400)
    ap.add_argument("--large", type=int, default=40_000)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    client = redis.Redis(a.host, a.port, a.db)
    small = measure(client, a.small, a.queues, a.runs)
    large = measure(client, a.large, a.queues, a.runs)
    out = {
        "queues": a.queues,
        "small": small,
        "large": large,
        "ls_ratio": large["ls_limit_5_s"] / small["ls_limit_5_s"],
        "show_ratio": large["show_s"] / small["show_s"],
    }
    if a.json:
        print(json.dumps(out))
        return
    for row in (small, large):
        print(
            f"{row['dead']:>7} dead jobs in {a.queues} queues: "
            f"dead ls --limit 5 {row['ls_limit_5_s'] * 1000:7.2f} ms, "
            f"dead show ID {row['show_s'] * 1000:6.2f} ms"
        )
    print(f"ratio {a.large}/{a.small}: ls {out['ls_ratio']:.2f}x, show {out['show_ratio']:.2f}x")


if __name__ == "__main__":
    main()
