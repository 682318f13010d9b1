"""Start and stop real ``celery worker`` processes for the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def suite_app(redis_url: str, prefix: str, lease_ms: int = 30000) -> Any:
    """The test process's app: on the suite's broker URL, results on ``redis_url``."""
    from tests.conftest import BROKER_OPTIONS, BROKER_URL

    from .app import client_app

    return client_app(
        redis_url, prefix, lease_ms, broker=BROKER_URL, broker_options=dict(BROKER_OPTIONS)
    )


def broker_env() -> dict[str, str]:
    """The environment naming the suite's broker to a worker of ``tests.e2e.app``."""
    from tests.conftest import BROKER_OPTIONS, BROKER_URL

    return {"EMQ_E2E_BROKER": BROKER_URL, "EMQ_E2E_BROKER_OPTIONS": json.dumps(BROKER_OPTIONS)}


def wait_for(cond: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll ``cond`` until it is truthy; return its value or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def lapsed_leases(client: Any, active_key: str) -> list[bytes]:
    """Return the ids in ``active_key`` whose lease deadline has passed."""
    now_ms = time.time() * 1000
    return [
        job
        for job, deadline in client.zrange(active_key, 0, -1, withscores=True)
        if deadline < now_ms
    ]


def run_celery(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.e2e.app <args>`` with ``env`` added; return it finished."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.e2e.app", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Worker:
    """One ``celery worker`` subprocess, logging to a file."""

    def __init__(self, env: dict[str, str], log: Path, name: str, *args: str) -> None:
        self.log = log
        self.name = name
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.e2e.app",
            "worker",
            "-n",
            f"{name}@%h",
            "-l",
            "info",
            "--without-mingle",
            "--without-gossip",
            *args,
        ]
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30) -> None:
        wait_for(lambda: " ready." in self.text() or self.proc.poll() is not None, timeout)
        if self.proc.poll() is not None:
            raise AssertionError(f"worker {self.name} exited early:\n{self.text()[-3000:]}")

    def warm_stop(self, timeout: float = 60) -> int:
        """SIGTERM (warm shutdown) and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the worker and its pool children (its own process group)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        else:
            # Children of an exited main process may linger in the group.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._fh.close()
