"""Drain-rate benchmark: the same workload through stock ``redis://`` and ``emq://``.

Each round pre-fills N ``tick`` tasks, starts one prefork worker, and measures
the drain rate from the first task run to the last; the publish rate and the
Redis memory held per queued task are measured on the way. Rounds alternate
between the transports so machine noise hits both alike. Prints a table and
the emq/stock ratios (medians).

    python bench/drain.py --tasks 2000 --rounds 3 --concurrency 2

With ``--roundtrips`` each round also counts the client round trips to Redis
(``bench/roundtrips.py``) of the publishing process and of the worker (its main
process and its pool children), and reports them per task.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import ROOT, add_redis_options, bench_worker, round_env


def one_round(scheme: str, args: argparse.Namespace) -> dict[str, float]:
    env = round_env(
        scheme, args.host, args.port, args.db, BENCH_ACKS_LATE="1" if args.acks_late else "0"
    )
    prefix = env["BENCH_PREFIX"]
    client = redis.Redis.from_url(env["BENCH_RECORD"])
    # Outside the round's prefix: read after the worker exited and its keys went.
    rt_key = f"benchrt{uuid.uuid4().hex[:8]}:"
    if args.roundtrips:
        env["BENCH_ROUNDTRIPS_URL"] = env["BENCH_RECORD"]
    # Publish from a child process so both transports pay the same import costs.
    publish = (
        "import time, bench.app as b\n"
        f"n = {args.tasks}\n"
        "t = time.perf_counter()\n"
        "with b.app.producer_or_acquire() as p:\n"
        "    for _ in range(n): b.tick.apply_async(producer=p)\n"
        "print(time.perf_counter() - t)\n"
    )
    mem0 = client.info("memory")["used_memory"]
    out = subprocess.run(
        [sys.executable, "-c", publish],
        cwd=ROOT,
        env={**env, "BENCH_ROUNDTRIPS_KEY": rt_key + "publish"},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    publish_s = float(out.stdout.strip().splitlines()[-1])
    mem_per_task = (client.info("memory")["used_memory"] - mem0) / args.tasks
    with bench_worker({**env, "BENCH_ROUNDTRIPS_KEY": rt_key + "worker"}, args.concurrency):
        deadline = time.monotonic() + args.timeout
        while int(client.get(prefix + "count") or 0) < args.tasks:
            if time.monotonic() > deadline:
                raise SystemExit(f"{scheme}: not drained within {args.timeout} s")
            time.sleep(0.05)
        first = float(client.get(prefix + "first") or 0)
        last = float(client.get(prefix + "last") or 0)
    res = {
        "drain_per_s": (args.tasks - 1) / (last - first),
        "publish_per_s": args.tasks / publish_s,
        "bytes_per_queued_task": mem_per_task,
    }
    if args.roundtrips:
        for side in ("publish", "worker"):
            res[f"rt_{side}_per_task"] = int(client.get(rt_key + side) or 0) / args.tasks
            client.delete(rt_key + side)
        res["rt_per_task"] = res["rt_publish_per_task"] + res["rt_worker_per_task"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--acks-late", action="store_true")
    add_redis_options(ap)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument(
        "--roundtrips", action="store_true", help="count client round trips to Redis per task"
    )
    args = ap.parse_args()

    results: dict[str, list[dict[str, float]]] = {"redis": [], "emq": []}
    for r in range(args.rounds):
        for scheme in ("redis", "emq"):
            res = one_round(scheme, args)
            results[scheme].append(res)
            print(
                f"round {r + 1} {scheme:5}  drain {res['drain_per_s']:8.0f}/s  "
                f"publish {res['publish_per_s']:8.0f}/s  "
                f"{res['bytes_per_queued_task']:6.0f} B/queued task"
                + (
                    f"  {res['rt_per_task']:5.2f} round trips/task "
                    f"(publish {res['rt_publish_per_task']:.2f}, "
                    f"worker {res['rt_worker_per_task']:.2f})"
                    if args.roundtrips
                    else ""
                ),
                flush=True,
            )
    print()
    print(
        f"{args.tasks} tasks, prefork -c {args.concurrency}, acks_late={args.acks_late}, "
        f"{args.rounds} rounds, medians:"
    )
    print(f"{'metric':24} {'redis://':>12} {'emq://':>12} {'emq/stock':>10}")
    metrics = ["drain_per_s", "publish_per_s", "bytes_per_queued_task"]
    if args.roundtrips:
        metrics += ["rt_per_task", "rt_publish_per_task", "rt_worker_per_task"]
    for metric in metrics:
        stock = statistics.median(x[metric] for x in results["redis"])
        emq = statistics.median(x[metric] for x in results["emq"])
        digits = 2 if metric.startswith("rt_") else 0
        print(f"{metric:24} {stock:12.{digits}f} {emq:12.{digits}f} {emq / stock:10.2f}")


if __name__ == "__main__":
    main()
