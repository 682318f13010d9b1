"""Fixtures for the broker fault tests: private servers, workers, a ledger.

The broker is a ``redis-server`` the test starts (and restarts, pauses, kills);
the ledger (runs, completions, results) stays on the suite's own Redis, so a
fault of the broker cannot touch what the test counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Worker

from .servers import REDIS_SERVER, RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start ``RedisServer(dir, aof, *extra)``; every one is stopped afterwards."""
    if REDIS_SERVER is None:
        pytest.skip("needs redis-server on PATH")
    servers: list[RedisServer] = []

    def start(*extra: str, aof: bool = False) -> RedisServer:
        s = RedisServer(tmp_path / f"redis{len(servers)}", aof, *extra)
        servers.append(s)
        s.start()
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def fault_worker(tmp_path: Path, redis_url: str, prefix: str) -> Iterator[Callable[..., Worker]]:
    """Start a worker of ``tests.e2e.app`` on ``broker``; the ledger is the suite's Redis."""
    workers: list[Worker] = []

    def start(broker: RedisServer, *args: str, name: str = "w", **env: str) -> Worker:
        base = {
            "EMQ_E2E_REDIS": broker.url,
            "EMQ_E2E_LEDGER": redis_url,
            "EMQ_E2E_PREFIX": prefix,
        }
        w = Worker({**base, **env}, tmp_path / f"{name}-{len(workers)}.log", name, *args)
        workers.append(w)
        w.wait_ready()
        return w

    yield start
    for w in workers:
        w.kill()
