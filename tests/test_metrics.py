"""The Prometheus collector: what one scrape reads from a store, and what it costs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.retry import Retry

from celery_emq.store.jobstore import JobStore

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from celery_emq.ops.metrics import EmqCollector  # noqa: E402

NOW = 10_000_000


def scrape(collector: EmqCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape through a registry and parse the text format back: {(name, labels): value}."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fill(store: JobStore, queue: str) -> None:
    """3 pending (one in lane g1), 2 active, 1 dead (malformed), 1 delayed."""
    for i in range(2):
        store.enqueue(queue, f"a{i}", "{}", now_ms=NOW - 60_000)
    assert len(store.claim(queue, "w1", count=2, now_ms=NOW - 50_000)) == 2
    store.enqueue(queue, "d0", "{}", now_ms=NOW)
    [dead] = store.claim(queue, "w1", now_ms=NOW)
    assert store.bury(queue, "d0", dead.token, "malformed", "bad", now_ms=NOW).name == "OK"
    store.enqueue(queue, "p0", "{}", now_ms=NOW - 30_000)
    store.enqueue(queue, "p1", "{}", now_ms=NOW - 20_000)
    store.enqueue(queue, "p2", "{}", now_ms=NOW - 40_000, group="g1")
    store.enqueue(queue, "e0", "{}", now_ms=NOW, eta_ms=NOW + 3_600_000)


def test_one_scrape_reads_counts_lanes_ages_and_counters(store: JobStore) -> None:
    fill(store, "q1")
    # A started job that stalls once (lease_expired) is recovered; one charged twice dies.
    store.enqueue("q2", "s0", "{}", now_ms=NOW)
    [c] = store.claim("q2", "w2", now_ms=NOW)
    store.start("q2", "s0", c.token)
    store.client.hset(store.keys("q2").base + "swept", "at", NOW + 2 * store.lease_ms)
    assert [s.outcome for s in store.sweep("q2", 1, now_ms=NOW + 2 * store.lease_ms)] == [
        "recovered"
    ]
    [c] = store.claim("q2", "w2", now_ms=NOW + 2 * store.lease_ms)
    store.start("q2", "s0", c.token)
    stale = c.token
    swept = store.charge("q2", "s0", c.token, 1, "worker_lost")
    assert swept is not None and swept.outcome == "dead"
    store.retry("q2", ["s0"])
    [c] = store.claim("q2", "w2")
    # The claim charged above is stale now: its renewal and ack are fenced.
    assert store.extend("q2", [("s0", stale)]) == [("s0", stale)]
    assert store.ack("q2", "s0", stale).name == "FENCED"
    store.ack("q2", "s0", c.token)
    for q in ("q1", "q2"):
        store.register(q)

    got = scrape(EmqCollector(store, now_ms=NOW))

    def q1(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"queue": "q1", **labels}.items())))]

    assert [q1("emq_queue_jobs", state=s) for s in ("pending", "active", "delayed", "dead")] == [
        3,
        2,
        1,
        1,
    ]
    assert q1("emq_lane_pending_jobs", group="g1") == 1
    assert q1("emq_oldest_pending_age_seconds") == 40.0
    assert q1("emq_oldest_lease_age_seconds") == 50.0
    assert q1("emq_jobs_dead_lettered_total", reason="malformed") == 1
    assert q1("emq_jobs_completed_total") == 0
    # The stall reasons show from 0, so that their first increase is seen.
    assert q1("emq_jobs_stalled_total", reason="worker_lost") == 0
    assert q1("emq_jobs_dead_lettered_total", reason="lease_expired") == 0

    def q2(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"queue": "q2", **labels}.items())))]

    assert q2("emq_jobs_stalled_total", reason="lease_expired") == 1
    assert q2("emq_jobs_stalled_total", reason="worker_lost") == 1
    assert q2("emq_jobs_recovered_total", reason="lease_expired") == 1
    assert q2("emq_jobs_dead_lettered_total", reason="worker_lost") == 1
    assert q2("emq_jobs_retried_total") == 1
    assert q2("emq_jobs_completed_total") == 1
    assert q2("emq_settles_fenced_total", reason="extend") == 1
    assert q2("emq_settles_fenced_total", reason="ack") == 1
    assert ("emq_settles_fenced_total", (("queue", "q1"), ("reason", "ack"))) not in got
    assert q2("emq_oldest_pending_age_seconds") == 0
    assert [q2("emq_queue_jobs", state=s) for s in ("pending", "active", "delayed", "dead")] == [
        0,
        0,
        0,
        0,
    ]
    assert got[("emq_up", ())] == 1


def test_counts_from_before_reasons_were_kept_show_as_unknown(store: JobStore) -> None:
    store.register("old")
    store.client.hset(store.keys("old").metrics("stalled"), mapping={"count": 5})
    store.client.hset(store.keys("old").metrics("stalled"), mapping={"reason:worker_lost": 2})
    got = scrape(EmqCollector(store))
    stalled = {
        dict(labels)["reason"]: v
        for (name, labels), v in got.items()
        if name == "emq_jobs_stalled_total"
    }
    assert stalled == {"worker_lost": 2, "unknown": 3, "lease_expired": 0}


class RoundTrips:
    """Count what redis-py writes to a socket: one per command or per pipeline."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        original = AbstractConnection.send_packed_command

        def counted(conn: Any, command: Any, check_health: bool = True) -> Any:
            self.n += 1
            return original(conn, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)


@pytest.fixture
def roundtrips(monkeypatch: pytest.MonkeyPatch) -> Iterator[RoundTrips]:
    yield RoundTrips(monkeypatch)


def test_a_scrape_of_100_queues_costs_the_round_trips_of_one(
    store: JobStore, client: redis.Redis, roundtrips: RoundTrips
) -> None:
    for i in range(100):
        q = f"q{i:03}"
        store.enqueue(q, "j", "{}")
        store.enqueue(q, "k", "{}", group=f"g{i % 3}")
        store.register(q)
    collector = EmqCollector(store)
    scrape(collector)  # loads the scripts and opens the connection
    roundtrips.n = 0
    got = scrape(collector)
    hundred = roundtrips.n
    assert sum(v for (n, _), v in got.items() if n == "emq_queue_jobs") == 200

    one = JobStore(client, store.prefix + "-one", store.lease_ms)
    one.enqueue("q", "j", "{}")
    one.register("q")
    try:
        scrape(EmqCollector(one))
        roundtrips.n = 0
        scrape(EmqCollector(one))
        print(f"round trips per scrape: 100 queues {hundred}, 1 queue {roundtrips.n}")
        assert hundred == roundtrips.n <= 4
    finally:
        for key in client.scan_iter(match=store.prefix + "-one*"):
            client.delete(key)


def test_a_broker_that_cannot_be_read_says_emq_up_0(client: redis.Redis, prefix: str) -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    got = scrape(EmqCollector(JobStore(dead, prefix + "emq", 5000)))
    assert got == {("emq_up", ()): 0}


def test_a_low_priority_job_behind_fresh_high_priority_ones_shows_its_age(
    store: JobStore,
) -> None:
    """The oldest pending job is found whatever its priority band or lane."""
    q = "q"
    store.enqueue(q, "starving", "{}", priority=9, now_ms=NOW - 23_000)
    store.enqueue(q, "lane-old", "{}", priority=5, group="g", now_ms=NOW - 25_000)
    k = store.keys(q)
    # 1,200 fresher high-priority jobs ahead of each, in the default lane and the lane.
    with store.client.pipeline() as pipe:
        for i in range(2400):
            lane = "g" if i % 2 else ""
            store.scripts.enqueue(k, f"h{i}", b"{}", 0, NOW - 2000 + i, group=lane, client=pipe)
        pipe.execute()
    got = scrape(EmqCollector(store, [q], now_ms=NOW))
    assert got[("emq_oldest_pending_age_seconds", (("queue", q),))] == 25.0
    # The lane's job leaves: the default lane's starving job is the oldest.
    store.client.zrem(k.lane("g"), "lane-old")
    got = scrape(EmqCollector(store, [q], now_ms=NOW))
    assert got[("emq_oldest_pending_age_seconds", (("queue", q),))] == 23.0


def test_a_recovered_job_ahead_of_its_band_counts_its_age(store: JobStore) -> None:
    q = "q"
    store.enqueue(q, "old", "{}", priority=3, now_ms=NOW - 90_000)
    [job] = store.claim(q, "w1", now_ms=NOW - 80_000)
    store.start(q, job.id, job.token)
    store.enqueue(q, "fresh", "{}", priority=3, now_ms=NOW - 1000)
    [swept] = store.sweep(q, max_stalled=5, now_ms=NOW - 80_000 + store.lease_ms + 1)
    assert swept.outcome == "recovered"
    got = scrape(EmqCollector(store, [q], now_ms=NOW))
    assert got[("emq_oldest_pending_age_seconds", (("queue", q),))] == 90.0


def test_the_oldest_lease_is_found_however_many_claims_are_held(store: JobStore) -> None:
    """Renewals reorder the active set: the earliest claim need not lead it."""
    q = "q"
    store.enqueue(q, "first", "{}", now_ms=1)
    [first] = store.claim(q, "w1", now_ms=NOW - 70_000)
    # Renewed far ahead: it sorts last of the active set.
    assert store.extend(q, [(first.id, first.token)], now_ms=NOW + 10**9) == []
    k = store.keys(q)
    with store.client.pipeline() as pipe:
        for i in range(1200):
            store.scripts.enqueue(k, f"j{i}", b"{}", 0, 1, client=pipe)
        pipe.execute()
    assert len(store.claim(q, "w2", count=1200, now_ms=NOW - 5000)) == 1200
    got = scrape(EmqCollector(store, [q], now_ms=NOW))
    assert got[("emq_oldest_lease_age_seconds", (("queue", q),))] == 70.0


def test_ages_read_past_the_first_page_of_lanes_and_claims(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_emq.store import jobstore as store_module

    monkeypatch.setattr(store_module, "OLDEST_LANE_PAGE", 2)
    monkeypatch.setattr(store_module, "ACTIVE_PAGE", 3)
    q = "q"
    for i in range(10):
        store.enqueue(q, f"a{i}", "{}", now_ms=1)
    for i, claimed_ms in enumerate([NOW - 1000] * 9 + [NOW - 33_000]):
        assert len(store.claim(q, "w", now_ms=claimed_ms)) == 1
        # Renewed so that the earliest claim sorts last of the active set.
        store.extend(q, [(f"a{i}", 1)], now_ms=NOW + i * 1000)
    for i in range(7):
        # The oldest pending job waits in the last lane, by name.
        store.enqueue(q, f"g{i}", "{}", group=f"lane{i}", now_ms=NOW - (44_000 if i == 6 else 1000))
    got = scrape(EmqCollector(store, [q], now_ms=NOW))
    assert got[("emq_oldest_pending_age_seconds", (("queue", q),))] == 44.0
    assert got[("emq_oldest_lease_age_seconds", (("queue", q),))] == 33.0
