"""Idle-cost benchmark: Redis commands a second from one idle worker, redis:// beside emq://.

Starts one prefork worker per transport with nothing to do, lets it settle, and
counts the commands Redis processes over a window (``INFO stats``
``total_commands_processed``, less this script's own two reads). Run it on a Redis
nothing else is using, or the figures include the other clients.

    python bench/idle.py --seconds 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]


def idle_rate(scheme: str, args: argparse.Namespace) -> float:
    prefix = f"idle{uuid.uuid4().hex[:8]}:"
    env = {
        **os.environ,
        "BENCH_BROKER": f"{scheme}://{args.host}:{args.port}/{args.db}",
        "BENCH_RECORD": f"redis://{args.host}:{args.port}/{args.db}",
        "BENCH_PREFIX": prefix,
    }
    client = redis.Redis(host=args.host, port=args.port, db=args.db)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.app",
            "worker",
            "-c",
            "2",
            "-P",
            "prefork",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "-l",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        time.sleep(args.settle)
        before = client.info("stats")["total_commands_processed"]
        time.sleep(args.seconds)
        after = client.info("stats")["total_commands_processed"]
    finally:
        worker.terminate()
        worker.wait(30)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
    return (after - before - 1) / args.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--settle", type=float, default=6)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=6379)
    ap.add_argument("--db", type=int, default=12)
    args = ap.parse_args()
    rates = {scheme: idle_rate(scheme, args) for scheme in ("redis", "emq")}
    print(f"idle prefork worker -c 2, {args.seconds:g} s window, Redis commands per second:")
    for scheme, rate in rates.items():
        print(f"  {scheme + '://':10} {rate:6.2f}")


if __name__ == "__main__":
    main()
