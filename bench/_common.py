"""What the benchmarks share: the environment of a round, a worker, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]


def round_env(scheme: str, host: str, port: int, db: int, **extra: str) -> dict[str, str]:
    """Return the environment of one round: broker URL, record URL, a fresh key prefix."""
    return {
        **os.environ,
        "BENCH_BROKER": f"{scheme}://{host}:{port}/{db}",
        "BENCH_RECORD": f"redis://{host}:{port}/{db}",
        "BENCH_PREFIX": f"bench{uuid.uuid4().hex[:8]}:",
        **extra,
    }


@contextmanager
def bench_worker(env: dict[str, str], concurrency: int, *extra: str) -> Iterator[None]:
    """Run one prefork worker of ``bench.app`` for the block; delete the round's keys after."""
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.app",
            "worker",
            "-c",
            str(concurrency),
            "-P",
            "prefork",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)
        scan_delete(redis.Redis.from_url(env["BENCH_RECORD"]), env["BENCH_PREFIX"])


def scan_delete(client: redis.Redis, prefix: str) -> None:
    """Delete every key under ``prefix`` (SCAN, never FLUSH*)."""
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])
