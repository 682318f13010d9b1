"""One node that hangs delays only its own share: lanes, the keeper, the sweeps, the settles.

A node that hangs is a store whose calls block on an event (released by a
timer, so no test waits for ever); the other node is the suite's Redis.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery

from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.nodes import Lanes
from celery_emq.transport import lease, settle
from celery_emq.transport.lease import Claim, delivery_tag
from celery_emq.transport.settle import SEND_BOUND_S, SettleBatcher
from celery_emq.transport.sweep_thread import SweepThread
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker.follow_up import CeleryFollowUp
from tests.conftest import ManualKeeper
from tests.faults.servers import StallingProxy

INTERVAL_MS = 1000
LEASE_MS = 3000
#: How long the sick node hangs at most (the timer releases it).
HANG_S = 10.0


class SickStore(JobStore):
    """A store on a node that hangs (from :meth:`hang`) until ``answer`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer = threading.Event()
        self.calls = 0
        self.hang()

    def hang(self) -> None:
        self.answer.clear()
        self.calls = 0
        timer = threading.Timer(HANG_S, self.answer.set)
        timer.daemon = True
        timer.start()

    def node_of(self, queue: str) -> str:
        return "sick:6379"

    @property
    def one_server(self) -> bool:
        return False  # each queue swept apart, as on a Cluster master

    def _hang(self) -> None:
        self.calls += 1
        self.answer.wait(HANG_S)

    def extend(self, *args: Any, **kwargs: Any) -> Any:
        self._hang()
        return super().extend(*args, **kwargs)

    def sweep(self, *args: Any, **kwargs: Any) -> Any:
        self._hang()
        return super().sweep(*args, **kwargs)

    def expire(self, *args: Any, **kwargs: Any) -> Any:
        self._hang()
        return super().expire(*args, **kwargs)


@pytest.fixture
def sick(client: redis.Redis, prefix: str) -> Iterator[SickStore]:
    store = SickStore(client, prefix + "sick", LEASE_MS)
    yield store
    store.answer.set()


@pytest.fixture
def healthy(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", LEASE_MS)


def _claim(store: JobStore, queue: str, job_id: str, now_ms: int) -> tuple[str, str]:
    store.enqueue(queue, job_id, b"{}", now_ms=now_ms)
    [job] = store.claim(queue, "me", now_ms=now_ms)
    return job.id, job.token


def test_lanes_bound_a_pass_and_skip_a_node_still_busy() -> None:
    lanes: Lanes[str] = Lanes("test-lanes")
    hung = threading.Event()
    try:
        began = time.monotonic()
        out = lanes.run({"a": lambda: 1, "b": lambda: hung.wait(HANG_S)}, timeout_s=0.3)
        assert 0.3 <= time.monotonic() - began < 1.0
        assert (out["a"].done, out["a"].value) == (True, 1)
        assert out["b"].late and out["b"].busy_s >= 0.3
        # The busy lane is not given more work: reported late at once.
        began = time.monotonic()
        out = lanes.run({"a": lambda: 2, "b": lambda: 3}, timeout_s=0.3)
        assert time.monotonic() - began < 0.2
        assert out["a"].value == 2 and out["b"].late
        hung.set()
        for _ in range(100):
            if not lanes._lanes["b"].busy:
                break
            time.sleep(0.01)
        out = lanes.run({"a": lambda: 1 / 0, "b": lambda: 3}, timeout_s=0.3)
        assert isinstance(out["a"].error, ZeroDivisionError)
        assert (out["b"].done, out["b"].value) == (True, 3)
    finally:
        hung.set()
        lanes.close(1.0)


def test_a_hung_node_delays_no_other_nodes_renewal_and_is_named(
    healthy: JobStore, sick: SickStore, caplog: pytest.LogCaptureFixture
) -> None:
    keeper = ManualKeeper("me")
    now_ms = 1000
    mine = _claim(healthy, "celery", "a", now_ms)
    theirs = _claim(sick, "celery", "b", now_ms)
    keeper.hold(sick, "celery", [theirs], INTERVAL_MS)
    keeper.hold(healthy, "celery", [mine], INTERVAL_MS)
    caplog.set_level(logging.WARNING, "celery_emq")
    sick.answer.set()
    keeper.renew_once(now_ms=4000)  # both answer
    time.sleep(0.5)
    sick.hang()
    began = time.monotonic()
    assert keeper.renew_once(now_ms=5000) == []
    took_s = time.monotonic() - began
    # The pass ended within its bound; the healthy node's lease was renewed.
    assert took_s < INTERVAL_MS / 1000 + 0.5, took_s
    assert healthy.client.zscore(healthy.keys("celery").active, "a") == 5000 + LEASE_MS
    assert sick.calls == 1
    # One interval late is no risk yet to a lease of three: no warning.
    assert not [r for r in caplog.records if "late" in r.getMessage()]
    time.sleep(0.6)
    # The next pass does not queue behind the call that hangs; the node is
    # now two intervals behind, and named once, with the figures.
    began = time.monotonic()
    keeper.renew_once(now_ms=5500)
    assert time.monotonic() - began < INTERVAL_MS / 1000
    assert sick.calls == 1
    assert healthy.client.zscore(healthy.keys("celery").active, "a") == 5500 + LEASE_MS
    keeper.renew_once(now_ms=5600)
    [late] = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    found = re.search(r"on sick:6379 is ([\d.]+) s late \(last renewed ([\d.]+) s ago", late)
    assert found, late
    assert 1.0 <= float(found[1]) <= 1.6 and 2.0 <= float(found[2]) <= 2.6, late
    assert keeper.overdue_nodes() == {"sick:6379"}
    # Once it answers, its lease is renewed and the trouble is over.
    sick.answer.set()
    for _ in range(50):
        if "sick:6379" not in keeper._late:
            break
        time.sleep(0.02)
    keeper.renew_once(now_ms=6000)
    assert sick.client.zscore(sick.keys("celery").active, "b") == 6000 + LEASE_MS
    assert keeper.overdue_nodes() == set()
    assert not keeper.is_lost(delivery_tag(*theirs))
    [again] = [r.getMessage() for r in caplog.records if "renewed again" in r.getMessage()]
    assert re.search(r"renewed again, \d+\.\d s after the renewal before", again), again


def test_a_hung_node_delays_no_other_nodes_sweep_nor_the_expiry_pass(
    app: Celery,
    healthy: JobStore,
    sick: SickStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lease, "_keeper", ManualKeeper("me"))  # holds nothing
    healthy.enqueue("celery", "lapsed", b"{}", now_ms=1000)
    healthy.claim("celery", "gone", now_ms=1000)
    # A bound wide enough that a healthy sweep on a loaded machine keeps within it.
    interval_s = 2.5
    options = EmqOptions(sweep_interval_s=interval_s, max_stalled=5)
    sweeps = SweepThread()
    sick_sweeper = Sweeper(sick, options, CeleryFollowUp(app))
    # As if its last sweep saw x-expires queues registered: the expiry pass runs.
    sick_sweeper.expiring = True
    sweeps.watch(sick_sweeper, "celery")
    sweeps.watch(Sweeper(healthy, options, CeleryFollowUp(app)), "celery")
    began = time.monotonic()
    [report] = sweeps.run_once(now_ms=10_000)
    took_s = time.monotonic() - began
    # The healthy queue was swept within the bound; the sick node's sweep and
    # the expiry pass (on the sick node's store too) did not hold it up.
    assert took_s < interval_s + 0.5, took_s
    assert report.queue == "celery" and report.requeued == ["lapsed"]
    # Its sweep, and its expiry pass (started, not waited for), each on a lane of its own.
    for _ in range(100):
        if sick.calls == 2:
            break
        time.sleep(0.01)
    assert sick.calls == 2
    # The next pass sweeps the healthy node again at once.
    healthy.claim("celery", "gone", now_ms=10_000)
    began = time.monotonic()
    reports = sweeps.run_once(now_ms=11_000)
    lanes = {node: lane.current for node, lane in sweeps._lanes._lanes.items()}
    assert len(reports) == 1, (reports, lanes)
    [report] = reports
    assert time.monotonic() - began < interval_s  # the busy sick lane was skipped
    assert report.recovered + report.requeued + report.graced == []  # not lapsed yet
    assert sick.calls == 2


def test_a_hung_server_delays_no_other_servers_settles(
    client: redis.Redis, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owed_to = ManualKeeper("me")
    monkeypatch.setattr(settle, "keeper", lambda: owed_to)
    proxy = StallingProxy(urlparse(redis_url).port or 6379)
    db = int(urlparse(redis_url).path.lstrip("/") or 0)
    stalled = redis.Redis(port=proxy.port, db=db, socket_timeout=3)
    sending: list[SettleBatcher] = []
    try:
        healthy = JobStore(client, prefix + "emq", LEASE_MS)
        sick = JobStore(stalled, prefix + "sick", LEASE_MS)
        claims = [Claim(s, "q", *_claim(s, "q", j, 1000)) for s, j in ((sick, "s"), (healthy, "h"))]
        assert proxy.freeze() >= 1  # the sick store's connection, open and silent
        time.sleep(0.3)  # a receive under way when it froze still goes through
        batcher = SettleBatcher()
        sending.append(batcher)
        began = time.monotonic()
        batcher.ack(claims)  # not deferring: sent at once
        took_s = time.monotonic() - began
        # The healthy server's ack went through within the bound; the sick
        # one's is owed to the keeper, which acks it with that server's renewals.
        assert took_s < SEND_BOUND_S + 0.5, took_s
        assert healthy.job("q", "h") == {}
        assert owed_to.owed_count() == 1
        assert owed_to.get(delivery_tag("s", claims[0].token)) == claims[0]
    finally:
        proxy.close()
        # The send to the sick server ends (its connection closed) and owes
        # its ack again: to this test's keeper, not to the process's.
        for batcher in sending:
            batcher._lanes.close(10.0)
        stalled.close()


class SlowStore(JobStore):
    """A store whose first renewal takes ``slow_s`` (a busy machine), then answers at once."""

    slow_s = 1.3

    def extend(self, *args: Any, **kwargs: Any) -> Any:
        if self.slow_s:
            time.sleep(self.slow_s)
            self.slow_s = 0.0
        return super().extend(*args, **kwargs)


def test_a_renewal_a_little_late_is_no_warning(
    client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A pass that ends after its interval, though the lease (three intervals)
    # was never at risk: said at debug level only, and nothing when it is over.
    store = SlowStore(client, prefix + "emq", LEASE_MS)
    keeper = ManualKeeper("me")
    keeper.hold(store, "celery", [_claim(store, "celery", "a", 1000)], INTERVAL_MS)
    caplog.set_level(logging.DEBUG, "celery_emq")
    keeper.renew_once(now_ms=2000)
    time.sleep(0.4)
    keeper.renew_once(now_ms=3000)
    assert store.client.zscore(store.keys("celery").active, "a") == 3000 + LEASE_MS
    # Only what this keeper says of its node (a keeper thread another test left
    # may still be talking of its own unreachable one).
    node = store.node_of("celery")
    mine = [r for r in caplog.records if node in r.getMessage()]
    late = [r for r in mine if "late" in r.getMessage()]
    assert [r.levelno for r in late] == [logging.DEBUG], [r.getMessage() for r in late]
    assert not [r.getMessage() for r in mine if r.levelno >= logging.WARNING]
