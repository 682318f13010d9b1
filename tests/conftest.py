"""Shared fixtures: a real Redis, a unique key prefix per test, cleanup after."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_emq.store.jobstore import JobStore
from celery_emq.transport.lease import LeaseKeeper

#: The Redis the tests talk to; a database of their own on the machine's server.
#: Always a direct URL (the master's): the result backend and key inspection use it.
REDIS_URL = os.environ.get("EMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
#: The broker URL of the apps and workers the tests start: by default the same
#: server through ``emq://``, or another form of it (``emq+sentinel://...``).
BROKER_URL = os.environ.get("EMQ_TEST_BROKER_URL") or REDIS_URL.replace("redis://", "emq://", 1)
#: Transport options that URL needs (a JSON object, e.g. ``{"master_name": "m"}``).
BROKER_OPTIONS: dict[str, object] = json.loads(os.environ.get("EMQ_TEST_BROKER_OPTIONS") or "{}")
#: "1" when BROKER_URL is a Redis Cluster: the tests read its keys through a cluster client.
CLUSTER = os.environ.get("EMQ_TEST_CLUSTER") == "1"


def broker_client() -> Any:
    """A client reading the broker's keys: a RedisCluster on a cluster, else on REDIS_URL."""
    if CLUSTER:
        from kombu import Connection
        from redis.cluster import ClusterNode, RedisCluster

        from celery_emq.store.topology import target_of

        nodes = target_of(Connection(BROKER_URL)).nodes
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes])
    return redis.Redis.from_url(REDIS_URL)


def servers_of(client: Any) -> list[redis.Redis]:
    """A client per server behind ``client``: each node of a cluster, or the one server."""
    if hasattr(client, "get_nodes"):
        return [client.get_redis_connection(n) for n in client.get_nodes()]
    return [client]


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    """Delete every key under ``prefix`` (SCAN, never KEYS or FLUSH*)."""
    batch = []
    for key in client.scan_iter(match=prefix + "*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch.clear()
    if batch:
        client.delete(*batch)


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def broker_url() -> str:
    return BROKER_URL


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = broker_client()
    try:
        c.ping()
    except redis.RedisError as exc:  # pragma: no cover - environment
        pytest.fail(f"no Redis at {BROKER_URL if CLUSTER else REDIS_URL}: {exc}")
    yield c
    c.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test uses; its keys are deleted afterwards."""
    p = f"t{uuid.uuid4().hex[:10]}:"
    yield p
    delete_prefix(client, p)


@pytest.fixture
def app(redis_url: str, broker_url: str, prefix: str) -> Iterator[Celery]:
    """A Celery app on the test broker and the Redis result backend, under the test's prefix."""
    a = Celery("emqtest", set_as_current=False)
    a.conf.update(
        broker_url=broker_url,
        broker_transport_options={**BROKER_OPTIONS, "global_keyprefix": prefix},
        result_backend=redis_url,
        result_backend_transport_options={"global_keyprefix": prefix},
    )
    yield a
    a.close()


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", lease_ms=5000)


class ManualKeeper(LeaseKeeper):
    """A lease keeper that renews only when ``renew_once`` is called.

    The real keeper's thread renews at once on the server's clock when a first
    claim is held, which would race a test that moves time by hand.
    """

    def _run(self) -> None:
        return None


def bulk_enqueue(store: JobStore, queue: str, n: int, now_ms: int = 1) -> list[str]:
    """Enqueue ``n`` jobs ``"0".."n-1"`` through one pipeline; return their ids."""
    k = store.keys(queue)
    ids = [str(i) for i in range(n)]
    with store.client.pipeline() as pipe:
        for i in ids:
            store.scripts.enqueue(k, i, b"{}", 0, now_ms, client=pipe)
        pipe.execute()
    return ids


def token_of(store: JobStore, queue: str, job_id: str) -> str:
    """Return the token (claim id) of a job's live claim."""
    return store.job(queue, job_id)["claim"]


def started_mark(token: object) -> str:
    """What start.lua records in ``started`` for the claim ``token``: its delivery count."""
    return str(token).partition(".")[0]


def bulk_start(store: JobStore, queue: str, claims: list[tuple[str, str]]) -> None:
    """Record that each claim ``(id, token)`` started its task, through one pipeline."""
    k = store.keys(queue)
    script = store.scripts.registered["start"]
    with store.client.pipeline() as pipe:
        for job_id, token in claims:
            script(keys=[k.job(job_id), k.metrics("fenced")], args=[token], client=pipe)
        pipe.execute()


def dump_keys(client: redis.Redis, prefix: str) -> dict[bytes, tuple[bytes, int]]:
    """Return every key under ``prefix`` as ``DUMP`` output with its TTL (ms, 0: none)."""
    out: dict[bytes, tuple[bytes, int]] = {}
    for key in client.scan_iter(match=prefix + "*", count=1000):
        dumped = client.dump(key)
        if dumped is not None:
            out[key] = (dumped, max(0, client.pttl(key)))
    return out


def forget_writes(client: redis.Redis, prefix: str, dumps: dict[bytes, tuple[bytes, int]]) -> None:
    """Put the keys under ``prefix`` back as :func:`dump_keys` found them.

    What a server that lost its last writes holds: a restart from an older
    snapshot, or a replica promoted before it received them.
    """
    delete_prefix(client, prefix)
    for key, (dumped, ttl_ms) in dumps.items():
        client.restore(key, ttl_ms, dumped, replace=True)


def sweeps_ran_until(store: JobStore, queue: str, now_ms: int) -> None:
    """Record that sweeps of ``queue`` ran regularly up to ``now_ms``.

    A test that moves the clock by more than half a lease between two sweeps
    would otherwise meet the outage rule (a lapse in a gap between sweeps is
    granted one more lease); the tests of counting skip that gap explicitly.
    """
    store.client.hset(store.keys(queue).base + "swept", "at", now_ms)
