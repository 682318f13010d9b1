"""Idle-cost benchmark: Redis commands a second from one idle worker, redis:// beside emq://.

Starts one prefork worker per transport with nothing to do (no heartbeats), lets
it settle, and counts what Redis processes over a window, two ways:

- **sent**: the commands clients send, a script call counted once, from
  ``MONITOR`` (skipping the ``[N lua]`` lines, the commands scripts run), with
  a breakdown by command (``EVALSHA`` by script name);
- **processed**: ``INFO stats`` ``total_commands_processed``, which counts each
  command a script runs too (less this script's own reads).

Run it on a Redis nothing else is using (``MONITOR`` costs the server some
work; a private ``redis-server`` is best), or the figures include the other
clients.

    python bench/idle.py --port 6390 --seconds 20 --queues 1,5,20

``--queues`` runs the worker on that many queues (``-Q idle0,...``) per figure:
the stock transport's cost is one ``BRPOP`` a second whatever its queues; the
figures show whether ``emq://``'s grows with them.

Through Sentinel: ``--port`` names the master (where the commands are counted),
``--emq-url``/``--stock-url`` the broker URLs listing the sentinels, and
``--options '{"master_name": "m"}'`` what both need.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import add_redis_options, bench_worker, round_env
from bench.monitor import Monitor


@dataclass
class Idle:
    """One transport's idle window."""

    seconds: float
    processed: int = 0
    #: command (``EVALSHA <script>`` for a script call) -> times sent in the window
    sent: Counter[str] = field(default_factory=Counter)
    #: commands the scripts ran (``[N lua]`` lines) -> times
    inner: Counter[str] = field(default_factory=Counter)

    @property
    def sent_rate(self) -> float:
        return sum(self.sent.values()) / self.seconds

    @property
    def processed_rate(self) -> float:
        return self.processed / self.seconds


def idle(scheme: str, args: argparse.Namespace, queues: int = 1) -> Idle:
    env = round_env(scheme, args.host, args.port, args.db)
    url = {"emq": args.emq_url, "redis": args.stock_url}.get(scheme)
    if url:
        env["BENCH_BROKER"] = url
    env["BENCH_BROKER_OPTIONS"] = args.options
    client = redis.Redis.from_url(env["BENCH_RECORD"], single_connection_client=True)
    own = {client.client_info()["addr"]}
    result = Idle(args.seconds)
    # No socket timeout: an idle worker may send nothing for longer than redis-py's default.
    monitor = Monitor(redis.Redis.from_url(env["BENCH_RECORD"], socket_timeout=None), own)
    monitor.start()
    try:
        names = ",".join(f"idle{i}" for i in range(queues))
        with bench_worker(env, 2, "--without-heartbeat", "-Q", names):
            time.sleep(args.settle)
            before = client.info("stats")["total_commands_processed"]
            monitor.counting = True
            time.sleep(args.seconds)
            monitor.counting = False
            after = client.info("stats")["total_commands_processed"]
    finally:
        monitor.close()
    # Less the first INFO (counted before it returns); MONITOR lines are not commands.
    result.processed = after - before - 1
    result.sent = monitor.sent
    result.inner = monitor.inner
    if monitor.errors:
        print(f"{scheme}: {len(monitor.errors)} MONITOR lines unparsed: {monitor.errors[0]}")
    return result


def report(results: dict[str, Idle], queues: int = 1) -> None:
    seconds = next(iter(results.values())).seconds
    print(
        f"idle prefork worker -c 2 on {queues} queue(s), no heartbeats, "
        f"{seconds:g} s window, per second:"
    )
    print(f"  {'':34}" + "".join(f"{s + '://':>12}" for s in results))
    print(
        f"  {'sent (a script call once)':34}"
        + "".join(f"{r.sent_rate:12.2f}" for r in results.values())
    )
    print(
        f"  {'processed (INFO, script inner too)':34}"
        + "".join(f"{r.processed_rate:12.2f}" for r in results.values())
    )
    print("  sent, by command:")
    names = sorted({n for r in results.values() for n in r.sent})
    for name in names:
        print(
            f"    {name:32}"
            + "".join(f"{r.sent[name] / r.seconds:12.2f}" for r in results.values())
        )
    inner = sorted({n for r in results.values() for n in r.inner})
    if inner:
        print("  run inside scripts, by command:")
        for name in inner:
            print(
                f"    {name:32}"
                + "".join(f"{r.inner[name] / r.seconds:12.2f}" for r in results.values())
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--settle", type=float, default=6)
    ap.add_argument("--schemes", default="redis,emq", help="transports, comma-separated")
    ap.add_argument("--emq-url", help="the emq:// broker URL (default: emq:// on --host/--port)")
    ap.add_argument("--stock-url", help="the stock broker URL (default: redis:// on --host/--port)")
    ap.add_argument("--options", default="{}", help="more broker transport options (JSON)")
    ap.add_argument("--queues", default="1", help="queue counts to measure, comma-separated")
    add_redis_options(ap)
    args = ap.parse_args()
    schemes = args.schemes.split(",")
    summary: dict[int, dict[str, Idle]] = {}
    for n in (int(x) for x in args.queues.split(",")):
        summary[n] = {scheme: idle(scheme, args, n) for scheme in schemes}
        report(summary[n], n)
    print("commands sent a second (a script call once), by number of queues:")
    print(f"  {'queues':>8}" + "".join(f"{s + '://':>12}" for s in schemes))
    for n, results in summary.items():
        print(f"  {n:>8}" + "".join(f"{results[s].sent_rate:12.2f}" for s in schemes))


if __name__ == "__main__":
    main()
