"""tally: a queue's counts and its lanes in one script call per page of lanes."""

from __future__ import annotations

import pytest
import redis

from celery_emq.store import jobstore as store_module
from celery_emq.store.jobstore import JobStore
from celery_emq.store.status import queue_status


def test_counts_lanes_and_heads_of_every_state(store: JobStore) -> None:
    store.enqueue("q", "p", b"{}", now_ms=1000)
    store.enqueue("q", "a1", b"{}", group="a", now_ms=1100)
    store.enqueue("q", "a2", b"{}", group="a", now_ms=1200)
    store.enqueue("q", "b1", b"{}", group="b", now_ms=900)
    store.enqueue("q", "d", b"{}", eta_ms=10**13, now_ms=1000)
    store.enqueue("q", "x", b"{}", now_ms=1000)
    # Claims rotate over the lanes: the first goes to lane a.
    [job] = store.claim("q", "w", now_ms=1300)
    assert job.id == "a1"
    counts, lanes, heads = store.tally("q", heads=True)
    assert counts == {"pending": 4, "active": 1, "delayed": 1, "dead": 0, "lanes": 2}
    assert lanes == {"a": 1, "b": 1}
    assert sorted(heads) == [900, 1200]
    status = queue_status(store, "q", now_ms=2000)
    assert (status["pending"], status["active"], status["delayed"]) == (4, 1, 1)
    assert status["oldest_pending_age_ms"] == 1100
    assert status["oldest_lease_age_ms"] == 700


def test_lanes_are_read_page_by_page(
    store: JobStore, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "LANE_PAGE", 3)
    for i in range(8):
        store.enqueue("q", f"j{i}", b"{}", group=f"g{i}")
    counts, lanes, _ = store.tally("q")
    assert counts["pending"] == 8 and counts["lanes"] == 8
    assert lanes == {f"g{i}": 1 for i in range(8)}


def test_status_of_ten_thousand_lanes_takes_a_fixed_number_of_round_trips(
    store: JobStore, client: redis.Redis
) -> None:
    k = store.keys("q")
    with client.pipeline(transaction=False) as pipe:
        for i in range(10_000):
            store.scripts.enqueue(k, f"j{i}", b"{}", 0, 1000 + i, group=f"g{i:05d}", client=pipe)
        pipe.execute()
    sent: list[object] = []
    original = client.connection_pool.get_connection

    def counting(*args: object, **kwargs: object) -> object:
        sent.append(args)
        return original(*args, **kwargs)

    client.connection_pool.get_connection = counting  # type: ignore[method-assign]
    try:
        status = queue_status(store, "q")
    finally:
        client.connection_pool.get_connection = original  # type: ignore[method-assign]
    assert status["pending"] == 10_000 and len(status["lanes"]) == 10_000
    # tally and oldest (first pages), the further pages of oldest, the clock and counters.
    assert len(sent) <= 3
