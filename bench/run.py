"""Every benchmark figure, stock ``redis://`` beside ``emq://``, in one run.

    python bench/run.py            # the full run (about 20 minutes on 2 cores)
    python bench/run.py --quick    # every figure, small (about 2 minutes)
    python bench/run.py --only drain,latency --rounds 5

Rounds alternate between the transports (and which goes first), so machine
noise hits both alike; each figure is the median of its rounds. Prints one
table, writes the figures and every round to ``<out>/benchmarks.json`` and draws
the emq/stock ratios to ``<out>/benchmarks.svg`` (matplotlib, the ``bench``
extra). By default the transports run on a private ``redis-server`` (so the
memory figures see nothing else), the emq-only scaling figures always do.
See docs/benchmarks.md for what each figure measures.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import figures, scaling
from bench._common import ROOT, private_redis
from bench.figures import EMQ, STOCK, Target, median

FIGURES = ("drain", "publish", "latency", "held", "delayed", "roundtrips", "idle", "scaling")
#: Pools of the drain figure: (pool, concurrency).
POOLS = (("prefork", 2), ("threads", 4), ("solo", 1))

#: Sizes of the full run and of ``--quick``.
FULL = {
    "rounds": 3,
    "tasks": 2000,
    "latency_rate": 200.0,
    "latency_seconds": 10.0,
    "held_tasks": 1000,
    "delayed_tasks": 100_000,
    "delayed_rounds": 1,
    "settle_s": 5.0,
    "rt_tasks": 2000,
    "rt_idle_s": 3.0,
    "idle_seconds": 20.0,
    "scale_small": 1000,
    "scale_large": 1_000_000,
    "scale_active": 100_000,
    "scale_lanes": 10_000,
    "scale_samples": 2000,
    "scale_passes": 20,
}
QUICK = {
    "rounds": 1,
    "tasks": 200,
    "latency_rate": 100.0,
    "latency_seconds": 2.0,
    "held_tasks": 100,
    "delayed_tasks": 500,
    "delayed_rounds": 1,
    "settle_s": 2.0,
    "rt_tasks": 200,
    "rt_idle_s": 1.0,
    "idle_seconds": 3.0,
    "scale_small": 1000,
    "scale_large": 20_000,
    "scale_active": 5_000,
    "scale_lanes": 500,
    "scale_samples": 200,
    "scale_passes": 5,
}

#: The issue's targets for the emq-only figures.
CLAIM_RATIO_TARGET = 1.5
SWEEP_TARGET_MS = 2.0
STATUS_TARGET_MS = 100.0
#: The chart's scale ends at 2**4 = 16 times either way.
CHART_MAX_LOG2 = 4.0


@dataclass(frozen=True)
class Row:
    """One line of the comparison table."""

    key: str
    label: str
    unit: str
    #: "higher" or "lower": which way emq/stock is better.
    better: str
    stock: float | None
    emq: float | None

    @property
    def ratio(self) -> float | None:
        if self.stock is None or self.emq is None or not self.stock:
            return None
        if math.isnan(self.stock) or math.isnan(self.emq):
            return None
        return self.emq / self.stock


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a timeout, a CI stop) unwinds like Ctrl-C, so each worker and
    # the private redis-server are stopped by their context managers, not left
    # running in sessions of their own.
    signal.signal(signal.SIGTERM, _terminated)
    args = parse(argv)
    if args.replot:
        return replot(Path(args.replot), args)
    started = time.monotonic()
    log = _logger()
    chosen = set(args.only.split(",")) if args.only else set(FIGURES)
    chosen -= set(args.skip.split(",")) if args.skip else set()
    unknown = chosen - set(FIGURES)
    if unknown:
        raise SystemExit(f"unknown figure(s): {', '.join(sorted(unknown))}")

    rounds: dict[str, list[dict[str, Any]]] = {}
    server: dict[str, Any] = {}
    with _redis(args.redis) as target:
        server = _server(target)
        log(f"redis:// and emq:// on {target.host}:{target.port}/{target.db}, {server}")
        comparisons: list[tuple[str, Callable[[str], dict[str, Any]], int]] = []
        if "drain" in chosen:
            for pool, conc in POOLS:
                if pool not in args.pools.split(","):
                    continue
                for acks_late in (False, True):
                    name = f"drain:{pool}:{int(acks_late)}"
                    comparisons.append(
                        (
                            name,
                            _bind(
                                figures.drain_round,
                                target,
                                pool=pool,
                                concurrency=conc,
                                acks_late=acks_late,
                                n=args.tasks,
                                timeout_s=args.timeout,
                            ),
                            args.rounds,
                        )
                    )
        if "publish" in chosen:
            comparisons.append(
                (
                    "publish",
                    _bind(figures.publish_round, target, n=args.tasks, timeout_s=args.timeout),
                    args.rounds,
                )
            )
        if "latency" in chosen:
            comparisons.append(
                (
                    "latency",
                    _bind(
                        figures.latency_round,
                        target,
                        rate=args.latency_rate,
                        seconds=args.latency_seconds,
                        timeout_s=args.timeout,
                    ),
                    args.rounds,
                )
            )
        if "held" in chosen:
            comparisons.append(
                (
                    "held",
                    _bind(figures.held_round, target, n=args.held_tasks, timeout_s=args.timeout),
                    args.rounds,
                )
            )
        if "roundtrips" in chosen:
            if figures.roundtrips_available():
                comparisons.append(
                    (
                        "roundtrips",
                        _bind(
                            figures.roundtrips_round,
                            target,
                            n=args.rt_tasks,
                            timeout_s=args.timeout,
                            idle_s=args.rt_idle_s,
                        ),
                        args.rounds,
                    )
                )
            else:
                log("round trips: bench/roundtrips.py is not there: not measured")
        if "idle" in chosen:
            if args.redis == "private":
                comparisons.append(
                    (
                        "idle",
                        _bind(
                            figures.idle_round,
                            target,
                            seconds=args.idle_seconds,
                            settle_s=args.settle_s,
                            timeout_s=args.timeout,
                        ),
                        args.rounds,
                    )
                )
            else:
                log("idle: counts every client of the server, so only on a private one: skipped")
        if "delayed" in chosen:
            comparisons.append(
                (
                    "delayed",
                    _bind(
                        figures.delayed_round,
                        target,
                        n=args.delayed_tasks,
                        timeout_s=max(args.timeout, args.delayed_tasks / 200),
                        settle_s=args.settle_s,
                    ),
                    args.delayed_rounds,
                )
            )
        if comparisons:
            # A first round on a fresh server pays one-off costs (allocations,
            # caches, imports): run one of each transport and discard it.
            for scheme in (STOCK, EMQ):
                figures.drain_round(target, scheme, "prefork", 2, False, 200, args.timeout)
            log("warm-up round done (discarded)")
        for name, run_round, n_rounds in comparisons:
            rounds[name] = []
            for r in range(n_rounds):
                # Alternate which transport goes first, round by round.
                order = (STOCK, EMQ) if r % 2 == 0 else (EMQ, STOCK)
                for scheme in order:
                    t0 = time.monotonic()
                    res = run_round(scheme)
                    rounds[name].append({"round": r + 1, "scheme": scheme, **res})
                    log(
                        f"{name:18} round {r + 1} {scheme + '://':8} "
                        f"{_brief(res)}  ({time.monotonic() - t0:.0f} s)"
                    )

    scale: dict[str, Any] | None = None
    if "scaling" in chosen:
        log("emq-only scaling, on a private redis-server:")
        scale = scaling.run(
            args.scale_small,
            args.scale_large,
            args.scale_active,
            args.scale_lanes,
            args.scale_samples,
            args.scale_passes,
            log=log,
        )

    rows = table_rows(rounds, args, "roundtrips" in chosen)
    runtime_s = time.monotonic() - started
    text = render(rows, scale, args, runtime_s)
    print()
    print(text, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "meta": {**_meta(args, runtime_s, chosen), "redis_server": server},
        "table": [
            {
                "key": r.key,
                "figure": r.label,
                "unit": r.unit,
                "better": r.better,
                "redis": r.stock,
                "emq": r.emq,
                "emq_over_stock": r.ratio,
            }
            for r in rows
        ],
        "scaling": scale,
        "rounds": rounds,
    }
    (out / "benchmarks.json").write_text(json.dumps(_clean(result), indent=2) + "\n")
    log(f"wrote {out / 'benchmarks.json'}")
    if not args.no_chart:
        path = chart(rows, out / "benchmarks.svg", args)
        log(f"wrote {path}" if path else "no chart: matplotlib is not installed (extra 'bench')")
    return 0


def replot(path: Path, args: argparse.Namespace) -> int:
    """Print the table and redraw the chart of a finished run from its JSON."""
    saved = json.loads(path.read_text())
    run_args = argparse.Namespace(**saved["meta"]["args"])
    rows = [
        Row(r["key"], r["figure"], r["unit"], r["better"], r["redis"], r["emq"])
        for r in saved["table"]
    ]
    print(render(rows, saved.get("scaling"), run_args, saved["meta"]["runtime_s"]))
    out = Path(args.out) if args.out_given else path.parent
    if not args.no_chart:
        out.mkdir(parents=True, exist_ok=True)
        drawn = chart(rows, out / "benchmarks.svg", run_args)
        print(f"wrote {drawn}" if drawn else "no chart: matplotlib is not installed")
    return 0


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="every figure, small")
    ap.add_argument("--only", help=f"comma-separated figures of: {', '.join(FIGURES)}")
    ap.add_argument("--skip", help="comma-separated figures to leave out")
    ap.add_argument(
        "--redis",
        default="private",
        help="'private' (a redis-server of our own, the default) or a redis:// URL "
        "with a database for the transport figures (never 11)",
    )
    ap.add_argument(
        "--out",
        help="where benchmarks.json and .svg go (default docs/img; "
        "with --quick, /tmp/emq-bench-quick)",
    )
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument(
        "--replot",
        metavar="JSON",
        help="print the table and draw the chart again from a run's benchmarks.json "
        "(into --out, default beside it); runs nothing",
    )
    ap.add_argument("--timeout", type=float, default=300, help="bound on each wait (s)")
    ap.add_argument("--rounds", type=int, help="rounds of each comparison (3)")
    ap.add_argument("--tasks", type=int, help="tasks per drain and publish round (2000)")
    ap.add_argument(
        "--pools",
        default=",".join(pool for pool, _ in POOLS),
        help="pools of the drain figure (prefork,threads,solo)",
    )
    ap.add_argument("--latency-rate", type=float, help="paced load, tasks/s (200)")
    ap.add_argument("--latency-seconds", type=float, help="paced load duration (10)")
    ap.add_argument("--held-tasks", type=int, help="tasks a worker holds (1000)")
    ap.add_argument("--delayed-tasks", type=int, help="countdown=3600 tasks (100000)")
    ap.add_argument("--delayed-rounds", type=int, help="rounds of the delayed figure (1)")
    ap.add_argument("--settle-s", type=float, help="least wait before the delayed figure's RSS (5)")
    ap.add_argument("--rt-tasks", type=int, help="tasks per round-trip round (2000)")
    ap.add_argument("--rt-idle-s", type=float, help="idle window before a round-trip round (3)")
    ap.add_argument("--idle-seconds", type=float, help="window of the idle figure (20)")
    ap.add_argument("--scale-small", type=int, help="pending jobs, small claim (1000)")
    ap.add_argument("--scale-large", type=int, help="pending jobs, large claim (1000000)")
    ap.add_argument("--scale-active", type=int, help="active leases swept (100000)")
    ap.add_argument("--scale-lanes", type=int, help="fair lanes for status (10000)")
    ap.add_argument("--scale-samples", type=int, help="claims timed at each size (2000)")
    ap.add_argument("--scale-passes", type=int, help="status passes timed (20)")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.out_given = args.out is not None
    if args.out is None:
        args.out = "/tmp/emq-bench-quick" if args.quick else str(ROOT / "docs" / "img")
    return args


@contextmanager
def _redis(spec: str) -> Iterator[Target]:
    if spec == "private":
        with private_redis() as url:
            yield _target(url)
        return
    yield _target(spec)


def _target(url: str) -> Target:
    u = urlparse(url)
    if u.scheme != "redis":
        raise SystemExit(f"--redis: a redis:// URL, not {url!r}")
    db = int((u.path or "/0").lstrip("/") or 0)
    if db == 11:
        raise SystemExit("--redis: database 11 belongs to the test suite; pick another")
    return Target(u.hostname or "127.0.0.1", u.port or 6379, db)


def _server(target: Target) -> dict[str, Any]:
    import redis

    client = redis.Redis(host=target.host, port=target.port, db=target.db)
    try:
        info = client.info("server")
    finally:
        client.close()
    return {k: info.get(k) for k in ("redis_version", "valkey_version") if k in info}


def _bind(fn: Callable[..., dict[str, Any]], target: Target, **kw: Any) -> Callable[[str], Any]:
    return lambda scheme: fn(target, scheme, **kw)


def table_rows(
    rounds: dict[str, list[dict[str, Any]]], args: argparse.Namespace, rt_wanted: bool
) -> list[Row]:
    """The medians of every comparison, one row each."""

    def med(name: str, field: str, scheme: str) -> float | None:
        if name not in rounds:
            return None
        vals = [r[field] for r in rounds[name] if r["scheme"] == scheme and r[field] is not None]
        return median(vals) if vals else None

    def pooled(prefix: str, field: str, scheme: str) -> float | None:
        vals = [
            r[field]
            for name, rs in rounds.items()
            if name.startswith(prefix)
            for r in rs
            if r["scheme"] == scheme
        ]
        return median(vals) if vals else None

    def row(key: str, label: str, unit: str, better: str, name: str, field: str) -> Row:
        return Row(key, label, unit, better, med(name, field, STOCK), med(name, field, EMQ))

    rows: list[Row] = []
    if any(n.startswith("drain:") for n in rounds):
        rows.append(
            Row(
                "publish_per_s",
                "publish rate (apply_async loop)",
                "tasks/s",
                "higher",
                pooled("drain:", "publish_per_s", STOCK),
                pooled("drain:", "publish_per_s", EMQ),
            )
        )
        for pool, conc in POOLS:
            for acks_late in (False, True):
                name = f"drain:{pool}:{int(acks_late)}"
                if name not in rounds:
                    continue
                label = f"drain, {pool}" + (f" -c {conc}" if pool != "solo" else "")
                label += ", acks_late" if acks_late else ""
                rows.append(
                    row(name.replace(":", "_"), label, "tasks/s", "higher", name, "drain_per_s")
                )
    if "publish" in rounds:
        for field, label in (
            ("publish_single_per_s", "publish rate, noop tasks one by one"),
            ("publish_batched_per_s", "publish rate, noop tasks inside Producer.batch()"),
        ):
            rows.append(row(field, label, "tasks/s", "higher", "publish", field))
    if "latency" in rounds:
        pace = f"{args.latency_rate:g}/s for {args.latency_seconds:g} s"
        rows.append(
            row(
                "latency_p50_ms",
                f"latency p50, enqueue to start ({pace})",
                "ms",
                "lower",
                "latency",
                "latency_p50_ms",
            )
        )
        rows.append(
            row(
                "latency_p99_ms",
                f"latency p99, enqueue to start ({pace})",
                "ms",
                "lower",
                "latency",
                "latency_p99_ms",
            )
        )
    if any(n.startswith("drain:") for n in rounds):
        rows.append(
            Row(
                "bytes_per_queued_task",
                "Redis memory per queued task",
                "B",
                "lower",
                pooled("drain:", "bytes_per_queued_task", STOCK),
                pooled("drain:", "bytes_per_queued_task", EMQ),
            )
        )
    if "held" in rounds:
        rows.append(
            row(
                "bytes_per_held_task",
                "Redis memory per task held by a worker",
                "B",
                "lower",
                "held",
                "bytes_per_held_task",
            )
        )
    if "delayed" in rounds:
        rows.append(
            row(
                "bytes_per_delayed_task",
                "Redis memory per delayed task (countdown=3600)",
                "B",
                "lower",
                "delayed",
                "bytes_per_delayed_task",
            )
        )
    if "roundtrips" in rounds:
        rows.append(
            row(
                "rt_publisher_per_task",
                "round trips per task, publisher",
                "",
                "lower",
                "roundtrips",
                "rt_publisher_per_task",
            )
        )
        rows.append(
            row(
                "rt_worker_per_task",
                "round trips per task, worker",
                "",
                "lower",
                "roundtrips",
                "rt_worker_per_task",
            )
        )
        rows.append(
            row(
                "rt_per_task",
                "round trips per task, end to end",
                "",
                "lower",
                "roundtrips",
                "rt_per_task",
            )
        )
    elif rt_wanted:
        rows.append(
            Row(
                "rt_per_task",
                "round trips per task, end to end: not measured",
                "",
                "lower",
                None,
                None,
            )
        )
    if "idle" in rounds:
        rows.append(
            row(
                "idle_commands_per_s",
                "Redis commands a second (a script once), idle prefork -c 2",
                "/s",
                "lower",
                "idle",
                "idle_commands_per_s",
            )
        )
    if "delayed" in rounds:
        n = f"{args.delayed_tasks:,}"
        rows.append(
            row(
                "rss_growth_mb",
                f"worker RSS growth, {n} delayed tasks",
                "MB",
                "lower",
                "delayed",
                "rss_growth_mb",
            )
        )
        rows.append(
            Row(
                "status_delayed",
                f"delayed shown by emq status (of {n})",
                "",
                "higher",
                None,
                med("delayed", "status_delayed", EMQ),
            )
        )
    return rows


def render(
    rows: list[Row], scale: dict[str, Any] | None, args: argparse.Namespace, runtime_s: float
) -> str:
    """The table, as printed (and pasted into docs/benchmarks.md)."""
    lines: list[str] = []
    if rows:
        lines += [
            f"medians of {args.rounds} round(s) per transport"
            + (
                f" ({args.delayed_rounds} for the delayed figures)"
                if args.delayed_rounds != args.rounds
                else ""
            )
            + f"; {args.tasks:,} no-op tasks per drain round, prefetch multiplier 4",
            "",
            f"| {'figure':58} | {'unit':7} | {'redis://':>10} | {'emq://':>10} "
            f"| {'emq/stock':>9} |",
            f"|{'-' * 60}|{'-' * 9}|{'-' * 11}:|{'-' * 11}:|{'-' * 10}:|",
        ]
    for r in rows:
        lines.append(
            f"| {r.label:58} | {r.unit:7} | {_num(r.stock):>10} | {_num(r.emq):>10} "
            f"| {_num(r.ratio, ratio=True):>9} |"
        )
    if scale is not None:
        s = scale["sizes"]
        small, large = scale["claim_small"]["p50_ms"], scale["claim_large"]["p50_ms"]
        claim_ratio = large / small if small else float("nan")
        lines += [
            "",
            "emq only, on a private redis-server (client-side ms, p50 / p99):",
            "",
            f"| {'figure':58} | {'p50 ms':>8} | {'p99 ms':>8} | {'target':>22} | {'met':>4} |",
            f"|{'-' * 60}|{'-' * 9}:|{'-' * 9}:|{'-' * 23}:|{'-' * 5}:|",
        ]

        def line(label: str, fig: dict[str, float], target: str, met: bool | None) -> None:
            verdict = "" if met is None else ("yes" if met else "NO")
            lines.append(
                f"| {label:58} | {fig['p50_ms']:8.3f} | {fig['p99_ms']:8.3f} "
                f"| {target:>22} | {verdict:>4} |"
            )

        line(f"claim one job, {s['small']:,} pending", scale["claim_small"], "", None)
        line(
            f"claim one job, {s['large']:,} pending",
            scale["claim_large"],
            f"<= {CLAIM_RATIO_TARGET:g}x small ({claim_ratio:.2f}x)",
            claim_ratio <= CLAIM_RATIO_TARGET,
        )
        line(
            f"sweep pass, {s['active']:,} active leases, none lapsed",
            scale["sweep"],
            f"< {SWEEP_TARGET_MS:g} ms",
            scale["sweep"]["p50_ms"] < SWEEP_TARGET_MS,
        )
        line(
            f"queue_status, {scale['lanes_seen']:,} fair lanes",
            scale["status"],
            f"< {STATUS_TARGET_MS:g} ms",
            scale["status"]["p50_ms"] < STATUS_TARGET_MS,
        )
        if "flower" in scale:
            line(
                f"Flower queue length, {scale['lanes_seen']:,} fair lanes",
                scale["flower"],
                "",
                None,
            )
        else:
            label = "Flower queue length: not measured (flower not installed)"
            lines.append(f"| {label:58} | {'-':>8} | {'-':>8} | {'':>22} | {'':>4} |")
        lines.append(
            f"\nRedis memory per pending job at {s['large']:,} pending "
            f"({scale['payload_bytes']} B payload): {scale['bytes_per_pending_job']:,.0f} B"
        )
    lines.append(f"\nruntime {runtime_s / 60:.1f} min")
    return "\n".join(lines)


def chart(rows: list[Row], path: Path, args: argparse.Namespace) -> Path | None:
    """Draw the emq/stock ratio of every compared figure (log scale, 1 = parity)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plotted = [r for r in rows if r.ratio is not None]
    if not plotted:
        return None
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small, searchable
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(plotted) + 1.4))
    labels, ratios, colors = [], [], []
    for r in reversed(plotted):
        assert r.ratio is not None
        good = r.ratio >= 1 if r.better == "higher" else r.ratio <= 1
        labels.append(f"{r.label} ({r.better} is better)")
        ratios.append(r.ratio)
        colors.append("#2a7d4f" if good else "#b5452f")
    # A ratio past CHART_MAX_LOG2 doublings (or none at all: a figure that fell
    # to zero) is drawn to the edge, its label giving the value.
    logs = [
        max(-CHART_MAX_LOG2, min(CHART_MAX_LOG2, math.log2(x) if x > 0 else -math.inf))
        for x in ratios
    ]
    y = range(len(plotted))
    ax.barh(list(y), logs, color=colors, height=0.6)
    ax.axvline(0, color="black", linewidth=0.8)
    for i, x, lx in zip(y, ratios, logs, strict=True):
        ax.text(
            lx + (0.04 if lx >= 0 else -0.04),
            i,
            f"{x:.2f}x" if x >= 0.01 or x <= 0 else f"{x:.1g}x",
            va="center",
            ha="left" if lx >= 0 else "right",
            fontsize=8,
        )
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=8)
    lim = max(1.0, max(abs(lx) for lx in logs) + 0.8)
    ax.set_xlim(-lim, lim)
    ticks = list(range(-int(lim), int(lim) + 1))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{2.0**t:g}x" for t in ticks], fontsize=8)
    ax.set_xlabel("emq:// / redis:// (log scale; green: emq better, red: stock better)", fontsize=8)
    ax.set_title(f"emq:// against stock redis://, medians of {args.rounds} round(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path


def _num(x: float | None, ratio: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if ratio:
        return f"{x:.2f}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _brief(res: dict[str, Any]) -> str:
    return "  ".join(
        f"{k} {_num(v) if isinstance(v, float) else v}" for k, v in res.items() if v is not None
    )


def _logger() -> Callable[[str], None]:
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    return log


def _meta(args: argparse.Namespace, runtime_s: float, chosen: set[str]) -> dict[str, Any]:
    import celery
    import kombu
    import redis

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "commit": commit,
        "runtime_s": round(runtime_s, 1),
        "figures": sorted(chosen),
        "args": vars(args),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "redis_py": redis.__version__,
        "cpus": _cpus(),
    }


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _clean(value: Any) -> Any:
    """JSON-ready: NaN as null, tuples as lists, anything else unknown as text."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
