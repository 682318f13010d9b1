"""Process plumbing shared by the examples and the demo: start, wait for, stop.

Every example talks to ``$EMQ_EXAMPLE_REDIS_URL`` (default
``redis://127.0.0.1:6379/14``) under a key prefix of its own, which it deletes
when it starts and when it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("EMQ_EXAMPLE_REDIS_URL", "redis://127.0.0.1:6379/14")
LOGS = ROOT / ".emq"


def wait_for(cond: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll ``cond`` until truthy; return its value, or ``None`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    return None


def clean(prefix: str, url: str = REDIS_URL) -> None:
    """Delete every key under ``prefix`` in the Redis at ``url`` (SCAN, never FLUSH*)."""
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])


class Process:
    """A ``celery`` subprocess in its own process group, logging to ``.emq/<name>.log``."""

    def __init__(self, app: str, name: str, *args: str, env: dict[str, str] | None = None):
        LOGS.mkdir(exist_ok=True)
        self.log = LOGS / f"{name}.log"
        self._fh = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, *args],
            cwd=ROOT,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group (the worker and its pool)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a warm shutdown), then SIGKILL whatever is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._fh.close()


def worker(app: str, name: str, *args: str, env: dict[str, str] | None = None) -> Process:
    """Start ``celery worker`` and wait until it is ready."""
    p = Process(
        app,
        name,
        "worker",
        "-n",
        f"{name}@%h",
        "--without-mingle",
        "--without-gossip",
        "-l",
        "info",
        *args,
        env=env,
    )
    if not wait_for(lambda: " ready." in p.text() or p.proc.poll() is not None, 30):
        raise SystemExit(f"{name} did not start:\n{p.text()[-2000:]}")
    if p.proc.poll() is not None:
        raise SystemExit(f"{name} exited:\n{p.text()[-2000:]}")
    return p


@contextmanager
def running(*procs: Process) -> Iterator[None]:
    """Stop the given processes (warm, then by force) however the block ends."""
    try:
        yield
    finally:
        for p in procs:
            p.stop()
