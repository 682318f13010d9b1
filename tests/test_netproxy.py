"""bench/netproxy.py: every byte crosses, in order, half the added round trip late each way."""

from __future__ import annotations

import redis

from bench.netproxy import delaying_proxy, measured_rtt_ms
from tests.conftest import REDIS_URL


def test_the_proxy_adds_its_round_trip_and_keeps_order() -> None:
    target = redis.Redis.from_url(REDIS_URL)
    port = target.connection_pool.connection_kwargs.get("port", 6379)
    db = target.connection_pool.connection_kwargs.get("db", 0)
    direct = measured_rtt_ms(port, n=20)
    with delaying_proxy(port, rtt_ms=5.0, max_seconds=60) as proxied:
        assert measured_rtt_ms(proxied, n=20) >= 5.0 > direct
        client = redis.Redis(port=proxied, db=db)
        pipe = client.pipeline(transaction=False)
        for i in range(2000):
            pipe.echo(f"{i:05d}" * 20)
        # Pipelined replies all come back, in order, after one round trip.
        assert pipe.execute() == [f"{i:05d}".encode() * 20 for i in range(2000)]
        client.close()
    target.close()
