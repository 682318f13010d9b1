"""Where a publish's time goes: the transport's own part, and the rest.

Alternating rounds, each a child process publishing N no-op tasks
(``bench/publish.py``), for stock ``redis://`` and ``emq://``, each once as
it is and once with ``--no-store`` (the transport's ``_put`` stores nothing,
so what is left is Celery's and kombu's work, the same for both). The
difference is the transport's part: building what it stores, and the round
trip that stores it. Prints medians in microseconds a publish. Each round's keys (a prefix of its
own, in database 12 of the Redis on 127.0.0.1:6379 unless told otherwise) are
deleted after it.

    python bench/publish_parts.py --tasks 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import ROOT, add_redis_options, round_env, scan_delete

SCHEMES = ("redis", "emq")


def one_round(scheme: str, store: bool, args: argparse.Namespace) -> float:
    """Publish ``args.tasks`` tasks in a child; return the microseconds a publish."""
    env = round_env(scheme, args.host, args.port, args.db)
    cmd = [sys.executable, "-m", "bench.publish", "drained", str(args.tasks)]
    try:
        out = subprocess.run(
            cmd if store else [*cmd, "--no-store"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
    finally:
        scan_delete(redis.Redis.from_url(env["BENCH_RECORD"]), env["BENCH_PREFIX"])
    # The child times publishes 2..n (the first one connects).
    return float(out.stdout.split()[-1]) / (args.tasks - 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    add_redis_options(ap)
    ap.add_argument("--json", action="store_true", help="print the medians as JSON too")
    args = ap.parse_args()
    us: dict[tuple[str, bool], list[float]] = {(s, st): [] for s in SCHEMES for st in (True, False)}
    for r in range(args.rounds):
        # Which transport goes first alternates, so drift hits both alike.
        order = SCHEMES if r % 2 == 0 else SCHEMES[::-1]
        for scheme in order:
            for store in (True, False):
                us[(scheme, store)].append(one_round(scheme, store, args))
    med = {k: statistics.median(v) for k, v in us.items()}
    print(f"{args.tasks} publishes a round, medians of {args.rounds} rounds, us a publish")
    print(f"| {'':<30} | {'redis://':>9} | {'emq://':>9} | {'emq/stock':>9} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|{'-' * 11}|")
    rows = [
        ("whole publish", med[("redis", True)], med[("emq", True)]),
        ("without the transport's _put", med[("redis", False)], med[("emq", False)]),
        (
            "the transport's part",
            med[("redis", True)] - med[("redis", False)],
            med[("emq", True)] - med[("emq", False)],
        ),
    ]
    for name, stock, emq in rows:
        print(f"| {name:<30} | {stock:>9.1f} | {emq:>9.1f} | {emq / stock:>9.2f} |")
    print(f"publish rate emq/stock: {med[('redis', True)] / med[('emq', True)]:.2f}")
    if args.json:
        print(json.dumps({f"{s}{'' if st else ' no-store'}": v for (s, st), v in med.items()}))


if __name__ == "__main__":
    main()
