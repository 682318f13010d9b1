"""What the benchmarks share: the environment of a round, a worker, a Redis, cleanup."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]


def add_redis_options(ap: argparse.ArgumentParser) -> None:
    """The Redis a single-figure benchmark runs on: ``--host``, ``--port``, ``--db`` (12)."""
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=6379)
    ap.add_argument("--db", type=int, default=12)


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
def bench_worker(
    env: dict[str, str],
    concurrency: int,
    *extra: str,
    pool: str = "prefork",
    kill: bool = False,
    cleanup: bool = True,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run one worker of ``bench.app`` for the block; delete the round's keys after.

    The worker leads a process group of its own. It is stopped with SIGTERM (a
    warm shutdown, SIGKILL after 30 s), or at once with SIGKILL to the group
    when ``kill`` is set (a worker holding tasks it would wait for). Without
    ``cleanup`` the round's keys stay, for the caller to read and delete.
    """
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
            pool,
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
        yield worker
    finally:
        if kill:
            _killpg(worker.pid)
        else:
            worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            _killpg(worker.pid)
            worker.wait(10)
        if not kill:
            # A warm shutdown leaves pool children to exit on their own.
            _killpg(worker.pid)
        if cleanup:
            scan_delete(redis.Redis.from_url(env["BENCH_RECORD"]), env["BENCH_PREFIX"])


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def scan_delete(client: redis.Redis, prefix: str) -> None:
    """Delete every key under ``prefix`` (SCAN, never FLUSH*)."""
    batch: list[bytes] = []
    for key in client.scan_iter(match=prefix + "*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch.clear()
    if batch:
        client.delete(*batch)


def free_port() -> int:
    """Return a loopback port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    """``EMQ_REDIS_SERVER`` or the ``redis-server`` on PATH."""
    binary = os.environ.get("EMQ_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        raise SystemExit("no redis-server: put one on PATH or set EMQ_REDIS_SERVER")
    return binary


@contextmanager
def private_redis(timeout_s: float = 20, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """Run a ``redis-server`` of our own (no persistence) for the block; yield its URL.

    It listens on a free loopback port, in a temporary directory, and is
    stopped by PID afterwards; ``extra`` are more ``--name value`` arguments.
    """
    workdir = tempfile.mkdtemp(prefix="emq-bench-redis-")
    port = free_port()
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--logfile",
            os.path.join(workdir, "redis.log"),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"private redis-server on port {port} did not start"
                    ) from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def dataset_bytes(client: redis.Redis) -> int:
    """Redis memory less what its client connections hold (their buffers come and go).

    Call :func:`accounted` on ``client`` first: Redis counts a new connection's
    memory in ``mem_clients_normal`` only once its client cron has seen it.
    """
    info = client.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


def accounted(client: redis.Redis, wait_s: float = 0.3) -> redis.Redis:
    """Connect ``client`` and wait until Redis counts its connection's memory; return it.

    Until then ``used_memory`` holds the connection's buffers but
    ``mem_clients_normal`` does not (it is updated by the server's client cron,
    ten times a second), so the first :func:`dataset_bytes` reads about 20 KB
    short of the second.
    """
    client.ping()
    time.sleep(wait_s)
    return client


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: split after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _rss_bytes(p)
        todo.extend(children.get(p, ()))
    return total


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
