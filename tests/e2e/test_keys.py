"""End to end: what a running worker's remote control leaves in Redis: no key without an end."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery.app.control import Control

from .harness import Worker, wait_for

pytestmark = pytest.mark.slow

PINGS = 300


def keys_without_ttl(client: redis.Redis, prefix: str) -> list[bytes]:
    found = list(client.scan_iter(match=prefix + "*", count=1000))
    with client.pipeline(transaction=False) as pipe:
        for key in found:
            pipe.ttl(key)
        ttls = pipe.execute()
    return sorted(k for k, t in zip(found, ttls, strict=True) if t == -1)


def binding_members(client: redis.Redis, prefix: str) -> int:
    """Members of kombu's binding tables (sets without a TTL, that could grow inside)."""
    tables = list(client.scan_iter(match=prefix + "*_kombu.binding.*", count=1000))
    return sum(int(client.scard(t)) for t in tables if client.type(t) == b"set")


def test_inspect_pings_leave_no_key_without_a_ttl(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    worker = start_worker("-c", "1", name="keysw", EMQ_E2E_SWEEP_S="1")
    # Each `celery inspect ping` is a new process: a new reply queue. A new
    # Control per ping does the same here (kept alive, so no two share an id).
    # Their queues expire once unused for control_queue_expires (10 s by default).
    capp.conf.control_queue_expires = 1.0
    controls = [Control(capp) for _ in range(PINGS + 5)]
    assert len({c.mailbox.oid for c in controls}) == len(controls)
    for control in controls[:5]:
        assert control.inspect(timeout=5, limit=1).ping()
    before = keys_without_ttl(client, prefix)
    bound = binding_members(client, prefix)
    started = time.monotonic()
    for control in controls[5:]:
        assert control.inspect(timeout=5, limit=1).ping(), worker.log.read_text()[-2000:]
    elapsed = time.monotonic() - started
    after = keys_without_ttl(client, prefix)
    print(
        f"{PINGS} pings in {elapsed:.1f} s; keys without a TTL: {len(before)} -> {len(after)}; "
        f"binding members: {bound} -> {binding_members(client, prefix)}"
    )
    assert len(after) <= len(before) + 3, [k for k in after if k not in before][:10]
    # Nor does any of those keys grow inside: each reply queue's binding leaves with it.
    assert binding_members(client, prefix) <= bound + 3
    # Once they expired, the workers' expiry pass leaves no key of any reply queue.
    wait_for(lambda: not list(client.scan_iter(match=prefix + "*.reply.celery.pidbox}*")), 15, 0.5)
    assert client.scard(prefix + "emq:expiring") <= 1
