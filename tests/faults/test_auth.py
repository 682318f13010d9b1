"""A broker that refuses the credentials says so, not that it cannot be reached."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

from celery import Celery
from click.testing import CliRunner

from celery_emq.ops.cli import emq as emq_cli
from tests.e2e.harness import run_celery

from .servers import RedisServer


def test_wrong_password_is_an_auth_error_not_unreachable(
    redis_server: Callable[..., RedisServer], prefix: str
) -> None:
    e2e_env = {"EMQ_E2E_PREFIX": prefix}
    server = redis_server()
    server.client().config_set("requirepass", "right")
    for url, said in (
        (f"redis://:wrong@127.0.0.1:{server.port}/0", "refused the credentials"),
        (f"redis://127.0.0.1:{server.port}/0", "refused the credentials"),
        ("redis://127.0.0.1:1/0", "cannot reach the broker"),
    ):
        done = run_celery({**e2e_env, "EMQ_E2E_REDIS": url}, "emq", "status")
        assert done.returncode != 0
        assert said in done.stderr, (url, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        if "127.0.0.1:1/" not in url:
            assert "cannot reach" not in done.stderr


def test_refused_credentials_are_reported_at_once(
    redis_server: Callable[..., RedisServer], prefix: str
) -> None:
    server = redis_server()
    server.client().config_set("requirepass", "right")
    for url in (
        f"emq://:wrong@127.0.0.1:{server.port}/0",
        f"emq://127.0.0.1:{server.port}/0",
    ):
        app = Celery("auth", broker=url, set_as_current=False)
        t0 = time.monotonic()
        done = CliRunner().invoke(emq_cli, ["status"], obj=SimpleNamespace(app=app))
        took = time.monotonic() - t0
        assert done.exit_code == 1
        assert "the broker refused the credentials" in done.output, done.output
        # No retries: kombu's connection retry policy would take about 6 s.
        assert took < 1.5, took
