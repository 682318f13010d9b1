"""A store batch whose calls are built as they are sent, on a server that lost its scripts."""

from __future__ import annotations

from collections.abc import Callable

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import NewJob, Outcome
from tests.faults.servers import RedisServer


def test_a_lost_script_is_loaded_and_its_deferred_call_built_once(
    redis_server: Callable[..., RedisServer],
) -> None:
    server = redis_server()
    pool = redis.BlockingConnectionPool.from_url(server.url, max_connections=1, timeout=5)
    client = redis.Redis(connection_pool=pool)
    store = JobStore(client, "flush", 30_000)
    built: list[str | bytes] = []

    def prepare(payload: str | bytes) -> str | bytes:
        built.append(payload)
        return payload

    assert store.enqueue("warm", "w", b"{}") is Outcome.OK
    client.script_flush()
    batch = store.scripts.batch()
    handle = batch.enqueue_many(store.keys("q"), [NewJob("a", b'{"a": 1}')], None, 0, prepare)
    batch.execute()
    assert batch.result(handle) == [Outcome.OK]
    assert built == [b'{"a": 1}']  # built once, sent twice (EVALSHA, then EVAL)
    assert store.job("q", "a")["payload"] == '{"a": 1}'
    assert client.ping()
    client.close()
