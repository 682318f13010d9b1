"""A broker that refuses the credentials says so, not that it cannot be reached."""

from __future__ import annotations

from collections.abc import Callable

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
