"""What ``appendfsync always`` costs a publisher: publish rate with ``everysec`` and ``always``.

    python bench/fsync.py                 # 3 rounds of 2000 publishes each way
    python bench/fsync.py --n 500 --rounds 1

Starts a private ``redis-server`` with AOF on (a free loopback port, a temporary
directory on this machine's disk, stopped by PID afterwards) and publishes
through ``emq://`` from one kombu producer, switching ``appendfsync`` between
rounds (``CONFIG SET``): ``everysec`` (Redis's default with AOF: a host crash
can lose about the last second of writes) and ``always`` (an fsync before each
write is acknowledged). Rounds alternate which goes first; each figure is the
median of its rounds. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import private_redis
from bench.wait import publish_rate

MODES = ("everysec", "always")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="publishes per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with private_redis(extra=("--appendonly", "yes")) as url:
        admin = redis.Redis.from_url(url)
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                admin.config_set("appendfsync", mode)
                rates[mode].append(publish_rate(url, 0, args.n))
        admin.close()
    every, always = (statistics.median(rates[m]) for m in MODES)
    print(
        json.dumps(
            {
                "publishes_per_round": args.n,
                "rounds": args.rounds,
                "rate_everysec_per_s": round(every),
                "rate_always_per_s": round(always),
                "ratio_always_to_everysec": round(always / every, 3),
                "rounds_per_s": {k: [round(x) for x in v] for k, v in rates.items()},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
