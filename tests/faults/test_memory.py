"""A full Redis: a clear error on publish, nothing half-written; risky eviction flagged."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis
from kombu.exceptions import OperationalError

from celery_emq import BrokerFullError
from celery_emq.store.jobstore import JobStore
from celery_emq.store.server import check_server
from tests.e2e.app import client_app
from tests.e2e.harness import Worker, run_celery

from .servers import RedisServer


def test_a_full_redis_refuses_the_publish_clearly_and_writes_nothing(
    redis_server: Callable[..., RedisServer], prefix: str, redis_url: str
) -> None:
    broker = redis_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    capp = client_app(broker.url, prefix, 3000, ledger=redis_url)
    published = 0
    with pytest.raises(BrokerFullError) as raised:
        for _ in range(5000):
            capp.send_task("tests.e2e.app.sleepy", args=(0, "x" * 20_000))
            published += 1
    assert isinstance(raised.value, OperationalError)  # what kombu users already catch
    text = str(raised.value)
    assert "'celery'" in text and "out of memory" in text and "nothing was written" in text
    assert published > 0
    client = broker.client()
    store = JobStore(client, prefix + "emq", 3000)
    k = store.keys("celery")
    rows = set(client.scan_iter(match=k.job_prefix + "*", count=1000))  # SCAN may repeat
    # Every publish that returned is queued whole; the refused one left no trace.
    assert len(rows) == client.zcard(k.pending) == client.llen(k.wake) == published
    assert int(client.get(k.seq)) == published
    # Room again: publishing works again.
    client.config_set("maxmemory", "0")
    capp.send_task("tests.e2e.app.sleepy", args=(0, "y"))
    assert client.zcard(k.pending) == published + 1
    capp.close()


def test_an_eviction_policy_that_can_drop_jobs_is_flagged(
    redis_server: Callable[..., RedisServer],
    fault_worker: Callable[..., Worker],
    prefix: str,
) -> None:
    risky = redis_server("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    check = check_server(risky.client())
    assert check.maxmemory_policy == "allkeys-lru" and check.persistence == "none"
    [warning] = check.warnings
    assert "allkeys-lru" in warning and "noeviction" in warning
    worker = fault_worker(risky, "-P", "solo", name="risky")
    assert "maxmemory-policy is allkeys-lru" in worker.text()
    env = {"EMQ_E2E_REDIS": risky.url, "EMQ_E2E_PREFIX": prefix}
    shown = run_celery(env, "emq", "status", "--json")
    assert shown.returncode == 0, shown.stderr
    server = json.loads(shown.stdout)["server"]
    assert server["maxmemory_policy"] == "allkeys-lru" and server["warnings"] == [warning]
    assert "Redis keeps nothing on disk" in server["notes"][0]
    text = run_celery(env, "emq", "status").stdout
    assert "warning: maxmemory-policy is allkeys-lru" in text

    safe = redis_server("--maxmemory-policy", "noeviction", aof=True)
    check = check_server(safe.client())
    assert (check.warnings, check.notes, check.persistence) == ([], [], "aof")


def test_a_server_that_refuses_config_is_still_judged(redis_url: str) -> None:
    class NoConfig(redis.Redis):
        def config_get(self, *args: object, **kwargs: object) -> dict[str, str]:
            raise redis.ResponseError("unknown command 'CONFIG'")

    check = check_server(NoConfig.from_url(redis_url))
    assert check.persistence in ("unknown", "aof")
    assert check.maxmemory_policy
