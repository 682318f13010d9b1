"""End to end: ``celery emq exporter`` and a real Flower's ``/metrics`` report a known queue."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from celery_emq.store.jobstore import JobStore

from .harness import ROOT, wait_for
from .test_flower import free_port

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

NOW = 5_000_000


def known_contents(store: JobStore) -> None:
    """Queue ``celery``: 3 pending (one in lane ``tenant-a``), 2 active, 1 dead, 1 delayed."""
    q = "celery"
    store.register(q)
    store.enqueue(q, "a0", "{}")
    store.enqueue(q, "a1", "{}")
    assert len(store.claim(q, "w", count=2)) == 2
    store.enqueue(q, "d0", "{}")
    [dead] = store.claim(q, "w")
    assert store.bury(q, "d0", dead.token, "malformed", "bad").name == "OK"
    store.enqueue(q, "p0", "{}")
    store.enqueue(q, "p1", "{}")
    store.enqueue(q, "p2", "{}", group="tenant-a")
    store.enqueue(q, "e0", "{}", eta_ms=store.server_ms() + 3_600_000)


def scrape(
    port: int, path: str = "/metrics", timeout: float = 5
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("emq_")
    }


def jobs(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    return {
        dict(labels)["state"]: v
        for (name, labels), v in metrics.items()
        if name == "emq_queue_jobs" and dict(labels)["queue"] == "celery"
    }


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.e2e.app", *args],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen[bytes]) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        return None


EXPECTED = {"pending": 3, "active": 2, "delayed": 1, "dead": 1}


def test_the_exporter_serves_the_queue_counts_until_sigterm(
    store: JobStore, e2e_env: dict[str, str], tmp_path: Path
) -> None:
    known_contents(store)
    port = free_port()
    log = tmp_path / "exporter.log"
    exporter = start(["emq", "exporter", "--port", str(port)], e2e_env, log)
    try:
        # The first answers may come before the exporter read the store.
        metrics = wait_for(lambda: (m := scrape(port)) and jobs(m) and m, 30, interval=0.3)
        assert jobs(metrics) == EXPECTED
        lane = ("emq_lane_pending_jobs", (("group", "tenant-a"), ("queue", "celery")))
        assert metrics[lane] == 1
        dead = ("emq_jobs_dead_lettered_total", (("queue", "celery"), ("reason", "malformed")))
        assert metrics[dead] == 1
        assert metrics[("emq_up", ())] == 1
        # Each scrape reads the store afresh.
        store.enqueue("celery", "p3", "{}")
        assert jobs(scrape(port) or {})["pending"] == 4
        # A client that connects and sends nothing does not hold up another scrape.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
            idle.sendall(b"GET /metrics HTTP/1.1\r\n")
            started = time.monotonic()
            assert jobs(scrape(port, timeout=1) or {})["pending"] == 4
            assert time.monotonic() - started < 1
    finally:
        code = stop(exporter)
    assert code == 0, log.read_text()
    assert f"http://127.0.0.1:{port}/metrics" in log.read_text()


def test_flowers_own_metrics_show_the_queue_counts(
    store: JobStore, e2e_env: dict[str, str], tmp_path: Path
) -> None:
    known_contents(store)
    port = free_port()
    flower = start(flower_args(port, tmp_path / "flower.db"), e2e_env, tmp_path / "flower.log")
    try:
        metrics = wait_for(lambda: (m := scrape(port)) and jobs(m) and m, 30, interval=0.3)
        assert jobs(metrics) == EXPECTED
        store.enqueue("celery", "p3", "{}")
        assert jobs(scrape(port) or {})["pending"] == 4
        # The same series at /emq/metrics (no authentication: open to anyone, as /emq is).
        assert jobs(scrape(port, "/emq/metrics") or {})["pending"] == 4
    finally:
        stop(flower)


def test_flower_with_basic_auth_serves_emq_series_only_behind_it(
    store: JobStore, e2e_env: dict[str, str], tmp_path: Path
) -> None:
    known_contents(store)
    port, open_port = free_port(), free_port()
    guarded = start(
        [*flower_args(port, tmp_path / "a.db"), "--basic-auth=ops:s3cret"],
        e2e_env,
        tmp_path / "guarded.log",
    )
    unguarded = start(flower_args(open_port, tmp_path / "b.db"), e2e_env, tmp_path / "open.log")
    try:
        wait_for(lambda: families(open_port) is not None, 30, interval=0.3)
        own = wait_for(lambda: families(port), 30, interval=0.3)
        # Flower's /metrics stays open, with exactly Flower's own series.
        assert own and not any(name.startswith("emq_") for name in own)
        assert own == {n for n in families(open_port) or () if not n.startswith("emq_")}
        assert "flower_events" in own
        # Without credentials, no emq series anywhere.
        for path, credentials in (("/emq/metrics", None), ("/emq/metrics", "ops:wrong")):
            assert status(port, path, credentials) == 401
        # With them, the series are there.
        with urllib.request.urlopen(authorized(port, "/emq/metrics", "ops:s3cret"), timeout=5) as r:
            text = r.read().decode()
        served = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert jobs(served) == EXPECTED
    finally:
        stop(guarded)
        stop(unguarded)


def flower_args(port: int, db: Path) -> list[str]:
    return ["flower", f"--port={port}", "--address=127.0.0.1", f"--db={db}"]


def families(port: int) -> set[str] | None:
    """The names of the metric families Flower's ``/metrics`` serves, or None if it is not up."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {family.name for family in text_string_to_metric_families(text)}


def authorized(port: int, path: str, credentials: str | None) -> urllib.request.Request:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if credentials:
        token = base64.b64encode(credentials.encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    return request


def status(port: int, path: str, credentials: str | None) -> int:
    try:
        with urllib.request.urlopen(authorized(port, path, credentials), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
