"""End to end: a real Flower on an emq:// app sees workers, a dead-lettered task and queues."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError

from .harness import ROOT, Worker, wait_for

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


def test_flower_shows_dead_lettered_task_as_failed_and_queue_lengths(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
    tmp_path: Path,
) -> None:
    port = free_port()
    log = tmp_path / "flower.log"
    with open(log, "wb") as fh:
        flower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.e2e.app",
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
                f"--db={tmp_path / 'flower.db'}",
            ],
            cwd=ROOT,
            env={**os.environ, **e2e_env, "FLOWER_UNAUTHENTICATED_API": "true"},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: get(port, "/api/queues/length") is not None, 30, interval=0.5)
        start_worker("-c", "1", "-E", name="flowerw")
        wait_for(
            lambda: any("flowerw@" in w for w in (get(port, "/api/workers?refresh=1") or {})),
            30,
            interval=1,
        )
        ok = capp.send_task("tests.e2e.app.add", args=(1, 1))
        assert ok.get(timeout=20) == 2
        poisoned = capp.send_task("tests.e2e.app.poison", args=("flower",))
        with pytest.raises(StalledJobError):
            poisoned.get(timeout=60)

        def task_state() -> Any:
            tasks = get(port, "/api/tasks") or {}
            return tasks.get(poisoned.id)

        task = wait_for(
            lambda: (task_state() or {}).get("state") == "FAILURE" and task_state(),
            30,
            interval=0.5,
        )
        assert "StalledJobError" in (task.get("exception") or "")
        # The failure is shown on the worker that exists, and no other worker appears.
        assert (task.get("worker") or "").startswith("flowerw@"), task.get("worker")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers?json=1", timeout=5) as r:
            shown = [w["hostname"] for w in json.loads(r.read())["data"]]
        assert shown and all(name.startswith("flowerw@") for name in shown), shown
        assert (get(port, "/api/tasks") or {})[ok.id]["state"] == "SUCCESS"

        lengths = get(port, "/api/queues/length")
        [celery_q] = [q for q in lengths["active_queues"] if q["name"] == "celery"]
        assert celery_q == {
            "name": "celery",
            "messages": 0,
            "messages_ready": 0,
            "messages_unacknowledged": 0,
            "messages_dead": 1,
            "messages_delayed": 0,
        }
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/broker", timeout=5) as r:
            assert r.status == 200 and b'<tr id="celery">' in r.read()
    finally:
        flower.terminate()
        try:
            flower.wait(10)
        except subprocess.TimeoutExpired:
            flower.kill()
