"""With no ``now_ms`` given, every deadline is read on the Redis server's clock."""

from __future__ import annotations

import time

import pytest
import redis

from celery_emq import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from celery_emq.transport.sweeper import Sweeper

HOUR_MS = 3_600_000


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
def fast_host_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put this process's clock an hour ahead of the Redis server's."""
    real_time, real_time_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: real_time() + HOUR_MS / 1000)
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + HOUR_MS * 1_000_000)


def test_the_host_clock_is_an_hour_ahead(fast_host_clock: None, client: redis.Redis) -> None:
    assert time.time() * 1000 - server_ms(client) > HOUR_MS - 1000


def test_a_claim_without_now_ms_leases_on_the_server_clock(
    fast_host_clock: None, store: JobStore, client: redis.Redis
) -> None:
    before = server_ms(client)
    store.enqueue("q", "a", b"{}")
    [job] = store.claim("q", "w")
    after = server_ms(client)
    score = client.zscore(store.keys("q").active, "a")
    assert before + store.lease_ms <= score <= after + store.lease_ms
    assert after - before < 1000
    row = store.job("q", "a")
    assert before <= int(row["enqueued_ms"]) <= after
    assert before <= int(row["claimed_ms"]) <= after
    assert job.deliveries == 1


def test_every_timestamp_written_without_now_ms_is_the_server_clock(
    fast_host_clock: None, store: JobStore, client: redis.Redis
) -> None:
    before = server_ms(client)
    store.enqueue("q", "a", b"{}")
    store.enqueue("q", "b", b"{}")
    [a] = store.claim("q", "w")
    store.start("q", "a", a.token)
    assert store.extend("q", [("a", a.token)]) == []
    assert store.bury("q", "b", 0, "rejected", "") is Outcome.OK
    assert store.retry("q", ["b"]) == ["b"]
    store.bury("q", "b", 0, "rejected", "")
    after = server_ms(client)
    k = store.keys("q")
    assert before + store.lease_ms <= client.zscore(k.active, "a") <= after + store.lease_ms
    assert before <= client.zscore(k.dead, "b") <= after
    row = store.job("q", "b")
    assert before <= int(row["retried_ms"]) <= int(row["died_ms"]) <= after
    # Retention by age: a morgue an hour old by the host's clock is not old on the server's.
    swept = store.sweep("q", max_stalled=1, dead_max_age_ms=60_000)
    assert [s.id for s in swept if s.outcome == "trimmed"] == []
    assert client.zcard(k.dead) == 1


def test_a_sweep_without_now_ms_leaves_a_lease_the_server_clock_has_not_reached(
    fast_host_clock: None, store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}")
    [job] = store.claim("q", "w")
    assert store.start("q", "a", job.token) is Outcome.OK
    k = store.keys("q")
    deadline = client.zscore(k.active, "a")
    # The host believes the lease lapsed an hour ago; the server does not.
    assert time.time() * 1000 > deadline + HOUR_MS - store.lease_ms - 1000
    assert store.sweep("q", max_stalled=0) == []
    assert store.reap("q") == []
    report = Sweeper(store, EmqOptions(max_stalled=0)).sweep("q")
    assert (report.recovered, report.dead, report.requeued) == ([], [], [])
    assert client.zrange(k.active, 0, -1, withscores=True) == [(b"a", deadline)]
    row = store.job("q", "a")
    assert (row["state"], row["stalled"]) == ("active", "0")
    assert store.metrics("q")["stalled"] == 0


def test_a_sweep_without_now_ms_takes_a_lease_the_server_clock_passed(
    store: JobStore, client: redis.Redis
) -> None:
    store.enqueue("q", "a", b"{}")
    [job] = store.claim("q", "w", now_ms=server_ms(client) - store.lease_ms - 10)
    store.start("q", "a", job.token)
    [swept] = store.sweep("q", max_stalled=0)
    assert (swept.id, swept.outcome, swept.stalled) == ("a", "dead", 1)
