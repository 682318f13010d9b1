"""What ``wait_replicas`` costs a publisher: publish rate with WAIT off and on.

    python bench/wait.py                 # 3 rounds of 2000 publishes each way
    python bench/wait.py --n 500 --rounds 1

Starts a private master and a replica of it (``redis-server`` on free loopback
ports, stopped by PID afterwards) and publishes through ``emq://`` on the
master from one kombu producer: ``wait_replicas=0`` (no WAIT) and
``wait_replicas=1`` (each publish carries ``WAIT 1``, answered once the replica
acknowledged it). Rounds alternate which goes first; each figure is the median
of its rounds. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import private_redis


def publish_rate(url: str, wait_replicas: int, n: int) -> float:
    """Publish ``n`` small messages; return publishes per second."""
    from kombu import Connection, Exchange, Producer, Queue

    import celery_emq  # noqa: F401  (registers emq://)

    prefix = f"benchwait{uuid.uuid4().hex[:8]}:"
    q = Queue("w", Exchange("w", "direct"), routing_key="w")
    options = {"global_keyprefix": prefix, "wait_replicas": wait_replicas}
    with Connection(url.replace("redis://", "emq://", 1), transport_options=options) as conn:
        producer = Producer(conn)
        producer.publish({"i": 0}, exchange=q.exchange, routing_key="w", declare=[q])
        t0 = time.perf_counter()
        for i in range(1, n):
            producer.publish({"i": i}, exchange=q.exchange, routing_key="w")
        elapsed = time.perf_counter() - t0
        conn.default_channel.store.purge("w")
    return (n - 1) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="publishes per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with private_redis() as master_url:
        port = str(urlparse(master_url).port)
        with private_redis(extra=("--replicaof", "127.0.0.1", port)) as replica_url:
            replica = redis.Redis.from_url(replica_url, decode_responses=True)
            deadline = time.monotonic() + 30
            while replica.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not sync")
                time.sleep(0.1)
            rates: dict[int, list[float]] = {0: [], 1: []}
            for r in range(args.rounds):
                for wait in (0, 1) if r % 2 == 0 else (1, 0):
                    rates[wait].append(publish_rate(master_url, wait, args.n))
            off, on = statistics.median(rates[0]), statistics.median(rates[1])
            print(
                json.dumps(
                    {
                        "publishes_per_round": args.n,
                        "rounds": args.rounds,
                        "rate_wait_0_per_s": round(off),
                        "rate_wait_1_per_s": round(on),
                        "ratio_wait_1_to_0": round(on / off, 3),
                        "rounds_per_s": {k: [round(x) for x in v] for k, v in rates.items()},
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
