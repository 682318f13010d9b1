"""Scrape benchmark: what one Prometheus scrape of 100 queues costs (round trips, commands, time).

Fills ``--queues`` queues on a Redis you name, each with ``--pending`` pending jobs over
three priorities (a third in two fair lanes) and ``--active`` claimed ones, registers
them, then scrapes them through :class:`celery_emq.ops.metrics.EmqCollector` ``--scrapes``
times. Reports per scrape: the client's round trips (counted where redis-py writes to
the socket: a pipeline counts one), the commands Redis ran for it (``INFO
commandstats``, scripts' inner commands included; exact only on a Redis nothing else
uses) and the time (median and slowest). No worker runs: the queues are built by the
store's own scripts. The keys are deleted afterwards.

    python bench/scrape.py --port 6390 --queues 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import add_redis_options
from celery_emq.ops.metrics import EmqCollector
from celery_emq.store.jobstore import JobStore

_sent = 0


class CountingConnection(redis.Connection):
    """A connection that counts each write of one command or one pipeline (a round trip)."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        global _sent
        _sent += 1
        super().send_packed_command(command, check_health)


def fill(store: JobStore, queues: list[str], pending: int, active: int) -> None:
    for q in queues:
        k = store.keys(q)
        with store.client.pipeline(transaction=False) as pipe:
            for i in range(pending + active):
                group = ("", "", "", "a", "b")[i % 5] if i >= active else ""
                store.scripts.enqueue(
                    k, f"j{i}", b"{}", (0, 4, 9)[i % 3], None, group=group, client=pipe
                )
            pipe.execute()
        # The first jobs claimed are the default lane's: claim them in batches.
        claimed = 0
        while claimed < active:
            claimed += len(store.claim(q, "bench", count=min(1000, active - claimed)))
        store.register(q)


def commands(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def main() -> None:
    global _sent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queues", type=int, default=100)
    ap.add_argument("--pending", type=int, default=2000)
    ap.add_argument("--active", type=int, default=200)
    ap.add_argument("--scrapes", type=int, default=20)
    add_redis_options(ap)
    args = ap.parse_args()
    pool = redis.ConnectionPool(
        host=args.host, port=args.port, db=args.db, connection_class=CountingConnection
    )
    client = redis.Redis(connection_pool=pool)
    admin = redis.Redis(host=args.host, port=args.port, db=args.db)
    prefix = f"benchscrape{uuid.uuid4().hex[:8]}:emq"
    store = JobStore(client, prefix, 60_000)
    queues = [f"q{i:03}" for i in range(args.queues)]
    try:
        fill(store, queues, args.pending, args.active)
        collector = EmqCollector(store)
        list(collector.collect())  # loads the scripts, opens the connection
        trips, cmds, times = [], [], []
        for _ in range(args.scrapes):
            _sent, before = 0, commands(admin)
            started = time.perf_counter()
            families = list(collector.collect())
            times.append(time.perf_counter() - started)
            # Less the INFO of this reading itself.
            cmds.append(commands(admin) - before - 1)
            trips.append(_sent)
        samples = sum(len(f.samples) for f in families)
        print(
            f"{args.queues} queues x ({args.pending} pending in 3 priorities and 2 lanes, "
            f"{args.active} active): {samples} samples a scrape"
        )
        print(f"  round trips a scrape   {statistics.median(trips):.0f}")
        print(f"  Redis commands a scrape {statistics.median(cmds):.0f}")
        print(
            f"  time a scrape          median {statistics.median(times) * 1000:.1f} ms, "
            f"slowest {max(times) * 1000:.1f} ms"
        )
    finally:
        for key in admin.scan_iter(match=prefix + "*", count=1000):
            admin.delete(key)


if __name__ == "__main__":
    main()
