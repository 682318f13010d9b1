"""A half-open link (the peer looks alive and never answers) stops nothing for good.

A proxy the test starts on loopback forwards to the suite's Redis, then leaves
every connection open at that moment silent for ever.
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

import redis
from kombu import Connection

from celery_emq.store.jobstore import JobStore
from celery_emq.transport.lease import LeaseKeeper

from .servers import StallingProxy

LEASE_MS = 3000


def test_lease_renewal_survives_a_half_open_connection(redis_url: str, prefix: str) -> None:
    url = urlparse(redis_url)
    proxy = StallingProxy(url.port or 6379)
    conn = Connection(
        f"emq://127.0.0.1:{proxy.port}{url.path}",
        transport_options={"global_keyprefix": prefix, "lease_ms": LEASE_MS},
    )
    direct = JobStore(redis.Redis.from_url(redis_url), prefix + "emq", LEASE_MS)
    try:
        channel = conn.channel()
        store = channel.store
        assert channel.store_timeout_s == 1.0  # a third of the lease, at least 1 s
        keeper = LeaseKeeper("half-open-test")
        store.enqueue("q", "j", b"{}")
        [job] = store.claim("q", keeper.owner)
        [tag] = keeper.hold(store, "q", [(job.id, job.token)], channel.emq.renew_interval_ms)
        time.sleep(1.5)  # the keeper's connection is open and in use
        assert proxy.freeze() >= 1
        frozen_at = time.monotonic()
        renewals = keeper.renewals
        closest_ms = LEASE_MS
        while time.monotonic() - frozen_at < 3 * LEASE_MS / 1000:
            deadline = direct.client.zscore(direct.keys("q").active, "j")
            assert deadline is not None
            closest_ms = min(closest_ms, int(deadline) - direct.server_ms())
            time.sleep(0.1)
        print(f"\nclosest the lease came to lapsing: {closest_ms} ms before its deadline")
        assert closest_ms > 0, "the lease lapsed while its worker lived"
        assert keeper.renewals > renewals
        keeper.forget(tag)  # its thread goes idle: nothing left to renew
    finally:
        conn.release()
        proxy.close()


def test_a_store_call_on_a_half_open_connection_fails_within_its_timeout(
    redis_url: str, prefix: str
) -> None:
    url = urlparse(redis_url)
    proxy = StallingProxy(url.port or 6379)
    conn = Connection(
        f"emq://127.0.0.1:{proxy.port}{url.path}",
        transport_options={"global_keyprefix": prefix, "lease_ms": 6000},
    )
    try:
        store = conn.channel().store
        store.enqueue("q", "j", b"{}")
        proxy.freeze()
        # Every connection of the pool is frozen; new ones are not, so a caller
        # that retries gets through. One call must not wait for ever.
        pool = store.client.connection_pool
        assert pool.connection_kwargs["socket_timeout"] == 2.0
        assert pool.connection_kwargs["socket_keepalive"] is True
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(store.counts("q"))
            except redis.RedisError as exc:
                outcome.append(exc)

        started = time.monotonic()
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a store call hung on a half-open connection"
        took = time.monotonic() - started
        print(f"\nstore call on a half-open link: {outcome[0]!r} after {took:.2f} s")
    finally:
        conn.release()
        proxy.close()
