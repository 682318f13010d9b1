"""Idle-cost benchmark: Redis commands a second from one idle worker, redis:// beside emq://.

Starts one prefork worker per transport with nothing to do, lets it settle, and
counts the commands Redis processes over a window (``INFO stats``
``total_commands_processed``, less this script's own two reads). Run it on a Redis
nothing else is using, or the figures include the other clients.

    python bench/idle.py --seconds 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import add_redis_options, bench_worker, round_env


def idle_rate(scheme: str, args: argparse.Namespace) -> float:
    env = round_env(scheme, args.host, args.port, args.db)
    client = redis.Redis.from_url(env["BENCH_RECORD"])
    with bench_worker(env, 2, "--without-heartbeat"):
        time.sleep(args.settle)
        before = client.info("stats")["total_commands_processed"]
        time.sleep(args.seconds)
        after = client.info("stats")["total_commands_processed"]
    return (after - before - 1) / args.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--settle", type=float, default=6)
    add_redis_options(ap)
    args = ap.parse_args()
    rates = {scheme: idle_rate(scheme, args) for scheme in ("redis", "emq")}
    print(f"idle prefork worker -c 2, {args.seconds:g} s window, Redis commands per second:")
    for scheme, rate in rates.items():
        print(f"  {scheme + '://':10} {rate:6.2f}")


if __name__ == "__main__":
    main()
