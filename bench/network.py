"""The transport figures over an emulated network: stock and emq through a delaying proxy.

    python bench/network.py                         # loopback, +0.25 ms, +1 ms round trip
    python bench/network.py --rtt-ms 1 --rounds 3 --tasks 2000

Starts a private ``redis-server``, then for each added round trip (0 is
loopback, no proxy) runs ``bench/run.py --only drain,publish,latency --pools
prefork,threads`` against it through ``bench/netproxy.py`` (the proxy in front
of the server, both transports and the benchmark's own reads going through it).
Prints, per figure, the emq/stock ratio at each round trip beside the loopback
one, with the measured ``PING`` round trip, and writes every run's table to
``<out>/network.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import ROOT, private_redis
from bench.netproxy import delaying_proxy, measured_rtt_ms

FIGURES = "drain,publish,latency"
POOLS = "prefork,threads"


def run_through(port: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run the figures against ``127.0.0.1:port``; return the run's saved table."""
    cmd = [
        sys.executable,
        "bench/run.py",
        "--redis",
        f"redis://127.0.0.1:{port}/0",
        "--only",
        args.figures,
        "--pools",
        args.pools,
        "--rounds",
        str(args.rounds),
        "--tasks",
        str(args.tasks),
        "--latency-rate",
        str(args.latency_rate),
        "--latency-seconds",
        str(args.latency_seconds),
        "--timeout",
        str(args.timeout),
        "--out",
        str(out),
        "--no-chart",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.timeout * 20)
    saved: dict[str, Any] = json.loads((out / "benchmarks.json").read_text())
    return saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rtt-ms", type=float, nargs="+", default=[0.0, 0.25, 1.0], help="added round trips"
    )
    ap.add_argument("--figures", default=FIGURES)
    ap.add_argument("--pools", default=POOLS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=2000)
    # Paced well below what a worker drains at the largest round trip: the figure
    # is the latency of one task, not the wait behind a backlog.
    ap.add_argument("--latency-rate", type=float, default=50.0)
    ap.add_argument("--latency-seconds", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="/tmp/emq-bench-network")
    args = ap.parse_args()
    out = Path(args.out)
    runs: list[dict[str, Any]] = []
    with private_redis() as url:
        server_port = urlparse(url).port or 6379
        for rtt in args.rtt_ms:
            here = out / f"rtt-{rtt:g}"
            here.mkdir(parents=True, exist_ok=True)
            if rtt:
                with delaying_proxy(server_port, rtt, max_seconds=args.timeout * 30) as port:
                    ping = measured_rtt_ms(port)
                    saved = run_through(port, args, here)
            else:
                ping = measured_rtt_ms(server_port)
                saved = run_through(server_port, args, here)
            runs.append({"added_rtt_ms": rtt, "ping_ms": ping, "table": saved["table"]})
            # After each run, so an interrupted one keeps what it measured.
            (out / "network.json").write_text(json.dumps(runs, indent=2))
    print(render(runs))
    return 0


def render(runs: list[dict[str, Any]]) -> str:
    """One row per figure: each run's stock and emq value and their ratio."""
    head = "| figure | " + " | ".join(
        f"+{r['added_rtt_ms']:g} ms (PING {r['ping_ms']:.2f} ms): stock / emq / ratio" for r in runs
    )
    lines = [head + " |", "|---|" + "---:|" * len(runs)]
    keys = [row["key"] for row in runs[0]["table"]]
    for key in keys:
        cells = []
        label = key
        for r in runs:
            row = next((x for x in r["table"] if x["key"] == key), None)
            if row is None:
                cells.append("-")
                continue
            label = row["figure"]
            cells.append(
                f"{_num(row['redis'])} / {_num(row['emq'])} / {_num(row['emq_over_stock'])}"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
