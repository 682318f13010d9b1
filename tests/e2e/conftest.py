from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .harness import Worker, broker_env, suite_app


@pytest.fixture
def e2e_env(redis_url: str, prefix: str) -> dict[str, str]:
    return {
        "EMQ_E2E_REDIS": redis_url,
        "EMQ_E2E_PREFIX": prefix,
        "EMQ_E2E_LEASE_MS": "30000",
        **broker_env(),
    }


@pytest.fixture
def start_worker(tmp_path: Path, e2e_env: dict[str, str]) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def start(*args: str, name: str = "w", ready: bool = True, **env: str) -> Worker:
        w = Worker({**e2e_env, **env}, tmp_path / f"{name}-{len(workers)}.log", name, *args)
        workers.append(w)
        if ready:
            w.wait_ready()
        return w

    yield start
    for w in workers:
        w.kill()


@pytest.fixture
def capp(redis_url: str, prefix: str) -> Iterator[object]:
    c = suite_app(redis_url, prefix)
    yield c
    c.close()
