"""A queue that fails on its own (its Cluster slot migrating) waits alone.

Every per-node pass goes through a node's queues with one helper,
:func:`~celery_emq.store.nodes.each_queue`. Here a queue "migrating" is one
whose calls raise what redis-py raises while its slot moves (``ClusterError``
once its ``TRYAGAIN`` redirections ran out, ``TryAgainError``, ``AskError``);
every queue sits on the same node, the suite's Redis.
"""

from __future__ import annotations

import logging
import random
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from redis.exceptions import AskError, ClusterError, TryAgainError

from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.store.nodes import Lanes, Troubles, each_queue
from celery_emq.store.outcomes import Scan
from celery_emq.transport import lease
from celery_emq.transport.cluster import ClusterChannel
from celery_emq.transport.consuming import Consuming
from celery_emq.transport.sweep_thread import SweepThread
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker.follow_up import CeleryFollowUp
from tests.conftest import ManualKeeper

LEASE_MS = 3000
INTERVAL_MS = 1000
MIGRATING = "mig"


def test_each_queue_records_each_queues_outcome_and_goes_on_past_a_failing_one() -> None:
    calls: list[str] = []

    def fn(q: str) -> int:
        calls.append(q)
        if q == "b":
            raise ClusterError("TTL exhausted.")
        if q == "c":
            raise TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot")
        return len(q)

    out = each_queue(["a", "b", "c", "dd"], fn)
    assert calls == ["a", "b", "c", "dd"]
    assert [(q, o.done, o.value) for q, o in out.items()] == [
        ("a", True, 1),
        ("b", False, None),
        ("c", False, None),
        ("dd", True, 2),
    ]
    assert isinstance(out["b"].error, ClusterError)
    assert isinstance(out["c"].error, TryAgainError)


@pytest.mark.parametrize(
    "error", [redis.ConnectionError("refused"), redis.TimeoutError("timed out")]
)
def test_each_queue_stops_at_an_error_of_the_node_itself(error: Exception) -> None:
    calls: list[str] = []

    def fn(q: str) -> str:
        calls.append(q)
        if q == "b":
            raise error
        return q

    out = each_queue(["a", "b", "c", "d"], fn)
    # A node that hangs is not asked again for each of its queues in turn.
    assert calls == ["a", "b"]
    assert out["a"].value == "a"
    assert [out[q].error for q in "bcd"] == [error, error, error]


def test_each_queue_lets_what_is_not_an_exception_through() -> None:
    def fn(q: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        each_queue(["a"], fn)


class MigratingStore(JobStore):
    """A store whose queue ``mig`` fails as a migrating slot does; one node for all."""

    def node_of(self, queue: str) -> str:
        return "one:6379"

    @property
    def one_server(self) -> bool:
        return False  # each queue's calls apart, as on a Cluster master

    def extend(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        if queue == MIGRATING:
            raise ClusterError("TTL exhausted.")
        return super().extend(queue, *args, **kwargs)


def test_a_migrating_queue_stops_no_renewal_of_its_masters_other_queues(
    client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = MigratingStore(client, prefix + "emq", LEASE_MS)
    keeper = ManualKeeper("me")
    claims = {}
    for q in (MIGRATING, "ok"):
        store.enqueue(q, "j", b"{}", now_ms=1000)
        [job] = store.claim(q, "me", now_ms=1000)
        claims[q] = (job.id, job.token)
    # The migrating queue comes first: once, it stopped the others.
    keeper.hold(store, MIGRATING, [claims[MIGRATING]], INTERVAL_MS)
    keeper.hold(store, "ok", [claims["ok"]], INTERVAL_MS)
    caplog.set_level(logging.WARNING, "celery_emq")
    for now_ms in (2000, 3000):
        with pytest.raises(ClusterError):
            keeper.renew_once(now_ms=now_ms)
        assert client.zscore(store.keys("ok").active, "j") == now_ms + LEASE_MS
    assert client.zscore(store.keys(MIGRATING).active, "j") == 1000 + LEASE_MS
    # Only the migrating queue is overdue: the sweep leaves out only it.
    assert keeper.overdue_queues(intervals=0.5) == {(id(store), MIGRATING)}
    # Named once, as a queue; no node reported late.
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"{MIGRATING} on one:6379" in warnings[0], warnings
    assert not keeper.is_lost(keeper.hold(store, "ok", [claims["ok"]], INTERVAL_MS)[0])


class _Store:
    """What the channel's scan and claim ask of the store: one node, ``mig`` migrating."""

    def __init__(self, scan: Any = None) -> None:
        self._scan = scan

    def node_of(self, queue: str) -> str:
        return "one:6379"

    def scan(self, queues: list[str]) -> Scan:
        return self._scan(queues)  # type: ignore[no-any-return]


class _Channel(ClusterChannel):
    """The cluster channel's scan and claim alone, on a store the test gives it."""

    store: Any = None


def _channel(store: _Store) -> ClusterChannel:
    channel = object.__new__(_Channel)
    channel.store = store
    channel._scan_lanes = Lanes("test-scan")
    channel._unanswered = Troubles()
    channel._failing = Troubles()
    return channel


@pytest.mark.parametrize(
    "error",
    [
        ClusterError("TTL exhausted."),
        TryAgainError("Multiple keys request during rehashing of slot"),
        AskError("3999 127.0.0.1:7002"),
    ],
)
def test_a_claim_that_meets_a_migrating_slot_does_not_restart_the_consumer(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def claim(self: Any, queue: str, held: int) -> bool:
        calls.append(queue)
        if queue == MIGRATING:
            raise error
        return True

    monkeypatch.setattr(Consuming, "_claim_and_deliver", claim)
    channel = _channel(_Store())
    try:
        assert channel._claim_and_deliver(MIGRATING, held=1) is False
        assert channel._claim_and_deliver("ok", held=0) is True
        # The queue is named as failing on its own, not its master.
        assert MIGRATING in channel._failing and "one:6379" not in channel._unanswered
        assert calls == [MIGRATING, "ok"]
    finally:
        channel._scan_lanes.close(1.0)


def test_a_scan_leaves_out_a_migrating_queue_alone_and_a_dead_cluster_still_reconnects(
    client: redis.Redis, prefix: str
) -> None:
    store = MigratingStore(client, prefix + "emq", LEASE_MS)
    store.enqueue("ok", "j", b"{}", now_ms=1000)
    store.enqueue(MIGRATING, "j", b"{}", now_ms=1000)
    real_batch = store.scripts.batch

    def batch() -> Any:
        b = real_batch()
        promote = b.promote

        def failing(k: Any, limit: int) -> int:
            handle = promote(k, limit)
            if k.queue == MIGRATING:
                b._calls[-1] = ("promote", [k.pending], ["", "not a number"])
            return handle

        b.promote = failing  # type: ignore[method-assign]
        return b

    store.scripts.batch = batch  # type: ignore[method-assign]
    channel = _channel(_Store(store.scan))
    try:
        scan = channel._scan([MIGRATING, "ok"])
        assert scan.waiting == ["ok"]
        assert MIGRATING in channel._failing and "one:6379" not in channel._unanswered
        # The next scan that reads it ends its trouble.
        store.scripts.batch = real_batch  # type: ignore[method-assign]
        assert channel._scan([MIGRATING, "ok"]).waiting == [MIGRATING, "ok"]
        assert MIGRATING not in channel._failing

        def down(queues: list[str]) -> Scan:
            raise redis.ConnectionError("no node answers")

        # No master answers: the error reaches Celery, which reconnects.
        channel.store = _Store(down)  # type: ignore[assignment]
        with pytest.raises(redis.ConnectionError):
            channel._scan([MIGRATING, "ok"])
    finally:
        channel._scan_lanes.close(1.0)


class _Node:
    def __init__(self, port: int, hang_s: float) -> None:
        self.host, self.port, self.hang_s = "127.0.0.1", port, hang_s

    def ping(self) -> bool:
        if self.hang_s:
            time.sleep(self.hang_s)
            raise redis.TimeoutError("Timeout reading from socket")
        return True


class _Cluster:
    def __init__(self, nodes: list[_Node]) -> None:
        self.nodes = nodes

    def get_nodes(self) -> list[_Node]:
        return self.nodes

    def get_redis_connection(self, node: _Node) -> _Node:
        return node


def test_finding_a_live_node_waits_one_socket_timeout_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The nodes that hang come first: asked one after another, each cost a timeout.
    monkeypatch.setattr(random, "shuffle", lambda nodes: None)
    hang_s = 0.6
    channel = _channel(_Store())
    channel.store = SimpleNamespace(
        client=_Cluster([_Node(1, hang_s), _Node(2, hang_s), _Node(3, hang_s), _Node(4, 0)])
    )
    channel._node = None
    monkeypatch.setattr(_Channel, "store_timeout_s", hang_s, raising=False)
    try:
        began = time.monotonic()
        assert channel._live_node() == ("127.0.0.1", 4)
        assert time.monotonic() - began < hang_s / 2
        # No node answers: a connection error (Celery reconnects), within one timeout.
        channel._node = None
        channel.store = SimpleNamespace(client=_Cluster([_Node(1, hang_s), _Node(2, hang_s)]))
        began = time.monotonic()
        with pytest.raises(redis.ConnectionError, match="no node of the cluster answers"):
            channel._live_node()
        assert time.monotonic() - began < 2 * hang_s
    finally:
        channel._scan_lanes.close(1.0)


class MigratingSweeps(MigratingStore):
    """As :class:`MigratingStore`, its sweeps of ``mig`` failing too."""

    def sweep(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        if queue == MIGRATING:
            raise ClusterError("TTL exhausted.")
        return super().sweep(queue, *args, **kwargs)


def test_the_sweep_leaves_out_only_the_migrating_queue(
    app: Celery, client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MigratingSweeps(client, prefix + "emq", LEASE_MS)
    keeper = ManualKeeper("me")
    monkeypatch.setattr(lease, "_keeper", keeper)
    for q in (MIGRATING, "ok"):
        store.enqueue(q, "mine", b"{}", now_ms=1000)
        [job] = store.claim(q, "me", now_ms=1000)
        keeper.hold(store, q, [(job.id, job.token)], INTERVAL_MS)
        # Another worker's claim, lapsed: the sweep requeues it.
        store.enqueue(q, "lapsed", b"{}", now_ms=1000)
        store.claim(q, "gone", now_ms=1000)
    with pytest.raises(ClusterError):
        keeper.renew_once(now_ms=1000 + LEASE_MS)
    time.sleep(2.1 * INTERVAL_MS / 1000)  # past two intervals: the migrating queue is overdue
    with pytest.raises(ClusterError):
        keeper.renew_once(now_ms=1500 + LEASE_MS)
    options = EmqOptions(sweep_interval_s=1.0, max_stalled=5)
    sweeps = SweepThread()
    for q in (MIGRATING, "ok"):
        sweeps.watch(Sweeper(store, options, CeleryFollowUp(app)), q)
    # Before, the whole master was left out: no queue of it was swept.
    reports = sweeps.run_once(now_ms=1000 + 2 * LEASE_MS)
    # (The first sweep of a queue finds no sweep before it: the lapsed claim
    # is graced one lease, as after an outage, or requeued.)
    assert [(r.queue, r.requeued + r.graced) for r in reports] == [("ok", ["lapsed"])], reports
    assert client.zscore(store.keys("ok").active, "mine") == 1500 + 2 * LEASE_MS
