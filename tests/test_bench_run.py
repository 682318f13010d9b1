"""bench/run.py end to end on tiny sizes: every figure is taken, tabled and written.

The run starts its own private ``redis-server`` (so it needs one: on PATH or
``EMQ_REDIS_SERVER``) and real workers of both transports; the figures are not
judged here, only that each was measured and is plausible.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.figures import roundtrips_available
from bench.run import Row, chart

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--quick",
    "--tasks", "60",
    "--latency-rate", "50",
    "--latency-seconds", "1",
    "--held-tasks", "20",
    "--delayed-tasks", "40",
    "--settle-s", "1",
    "--rt-tasks", "60",
    "--rt-idle-s", "1",
    "--scale-small", "200",
    "--scale-large", "2000",
    "--scale-active", "500",
    "--scale-lanes", "50",
    "--scale-samples", "50",
    "--scale-passes", "3",
    "--timeout", "120",
]  # fmt: skip

has_server = bool(os.environ.get("EMQ_REDIS_SERVER") or shutil.which("redis-server"))


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``bench/run.py`` with ``args`` from the project's root; its output captured."""
    return subprocess.run(
        [sys.executable, "bench/run.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not has_server, reason="no redis-server for the benchmark's private Redis")
def test_quick_run_takes_every_figure(tmp_path: Path) -> None:
    out = run_bench(*TINY, "--out", str(tmp_path), "--no-chart", timeout=540)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "| drain, prefork -c 2, acks_late" in out.stdout
    saved = json.loads((tmp_path / "benchmarks.json").read_text())
    table = {row["key"]: row for row in saved["table"]}

    compared = [
        "publish_per_s",
        "publish_single_per_s",
        "publish_batched_per_s",
        *(f"drain_{pool}_{late}" for pool in ("prefork", "threads", "solo") for late in (0, 1)),
        "latency_p50_ms",
        "latency_p99_ms",
        "bytes_per_queued_task",
        "bytes_per_held_task",
        "bytes_per_delayed_task",
        "idle_commands_per_s",
        "rss_growth_mb",
    ]
    for key in compared:
        row = table[key]
        assert row["redis"] is not None and row["emq"] is not None, key
        assert math.isclose(row["emq_over_stock"], row["emq"] / row["redis"]), key
    # An RSS may grow by nothing, and an idle emq:// worker may send nothing in
    # a window shorter than its wait (stock's BRPOP returns every second).
    for key in compared[:-2]:
        assert table[key]["redis"] > 0 and table[key]["emq"] > 0, key
    assert table["idle_commands_per_s"]["redis"] > 0
    assert table["idle_commands_per_s"]["emq"] >= 0
    # A queued task holds at least its payload (a Celery message is ~1 KB).
    assert table["bytes_per_queued_task"]["redis"] > 300
    assert table["bytes_per_queued_task"]["emq"] > 300
    assert table["latency_p99_ms"]["emq"] >= table["latency_p50_ms"]["emq"]

    delayed = saved["rounds"]["delayed"]
    assert {r["scheme"] for r in delayed} == {"redis", "emq"}
    for r in delayed:
        assert r["n"] == 40
        assert r["rss_before_mb"] > 10 and r["rss_after_mb"] > 10
    assert table["status_delayed"]["emq"] is not None
    assert table["status_delayed"]["emq"] == 40

    if roundtrips_available():
        # One round trip to publish a task on either; the stock worker makes about
        # three a task (BRPOP, write the unacked record, delete it); the emq://
        # worker claims and settles in batches, but cannot take a task for nothing.
        for scheme in ("redis", "emq"):
            assert table["rt_publisher_per_task"][scheme] >= 0.9, scheme
        assert table["rt_worker_per_task"]["redis"] >= 2
        assert table["rt_worker_per_task"]["emq"] > 0.1
        assert table["rt_per_task"]["emq_over_stock"] is not None
    else:
        assert table["rt_per_task"]["emq"] is None
        assert "not measured" in table["rt_per_task"]["figure"]

    scale = saved["scaling"]
    assert scale["sizes"] == {"small": 200, "large": 2000, "active": 500, "lanes": 50}
    assert scale["lanes_seen"] == 50
    for fig in ("claim_small", "claim_large", "sweep", "status"):
        assert 0 < scale[fig]["p50_ms"] <= scale[fig]["p99_ms"], fig
    # A row, a sorted-set member and the message (compressed, maybe to a fifth).
    assert scale["bytes_per_pending_job"] > scale["payload_bytes"] / 10
    assert "claim one job, 2,000 pending" in out.stdout


def test_chart_draws_every_ratio(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import argparse

    rows = [
        Row("a", "drain", "tasks/s", "higher", 100.0, 150.0),
        Row("b", "memory", "B", "lower", 1000.0, 2000.0),
        Row("c", "not measured", "", "lower", None, None),
    ]
    path = chart(rows, tmp_path / "c.svg", argparse.Namespace(rounds=3))
    assert path is not None
    svg = path.read_text()
    assert "1.50x" in svg and "2.00x" in svg
    assert "not measured" not in svg


def test_replot_draws_into_a_directory_it_makes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    saved = ROOT / "docs" / "img" / "benchmarks.json"
    out = tmp_path / "new" / "dir"
    done = run_bench("--replot", str(saved), "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| drain, prefork -c 2, acks_late" in done.stdout
    first = json.loads(saved.read_text())["table"][0]
    assert f"{first['emq_over_stock']:.2f}x" in (out / "benchmarks.svg").read_text()


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not has_server, reason="no redis-server for the benchmark's private Redis")
def test_a_terminated_run_stops_its_worker_and_its_redis(tmp_path: Path) -> None:
    run = subprocess.Popen(
        [sys.executable, "bench/run.py", "--quick", "--only", "held", "--held-tasks", "20",
         "--out", str(tmp_path), "--no-chart"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = _children(run.pid)
            if any("celery" in cmd and "worker" in cmd for cmd in started.values()):
                break
            time.sleep(0.1)
        workers = [p for p, cmd in started.items() if "celery" in cmd]
        servers = [p for p, cmd in started.items() if "redis-server" in cmd]
        assert workers and servers, started
        run.terminate()
        run.wait(60)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and any(_alive(p) for p in workers + servers):
            time.sleep(0.2)
        assert not [p for p in workers + servers if _alive(p)]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
        # What the run left behind (the failure this test is about), by PID:
        # each worker leads a process group of its own.
        for pid, cmd in started.items():
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    if "celery" in cmd:
                        os.killpg(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_publish_parts_splits_a_publish(redis_url: str) -> None:
    from urllib.parse import urlsplit

    url = urlsplit(redis_url)
    where = ["--host", url.hostname or "127.0.0.1", "--port", str(url.port or 6379)]
    where += ["--db", url.path.strip("/") or "0"]
    cmd = [sys.executable, "bench/publish_parts.py", "--tasks", "300", "--rounds", "1", "--json"]
    out = subprocess.run(
        [*cmd, *where],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    med = json.loads(out.stdout.strip().splitlines()[-1])
    for scheme in ("redis", "emq"):
        # Storing nothing skips at least the round trip to Redis.
        assert 0 < med[f"{scheme} no-store"] < med[scheme], med
    assert "the transport's part" in out.stdout
