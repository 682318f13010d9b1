"""What a Cluster waker gives back when it pops a marker it cannot use."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.transport.wakers import Waker


def _waker(store: JobStore, client: redis.Redis) -> Waker:
    """A waker of queue ``q`` whose channel stands in for a cluster channel."""
    channel = SimpleNamespace(
        store=store,
        _nudge_id="t",
        _wake_lock=threading.Lock(),
        _wake_redis=lambda: client,
        _soon_keys={store.keys("q").soon},
    )
    return Waker(channel, {store.keys("q").wake: "q", store.keys("q").soon: "q"}, 1.0)  # type: ignore[arg-type]


def test_a_soon_marker_a_disarmed_waker_gives_back_keeps_its_end(
    store: JobStore, client: redis.Redis
) -> None:
    # Popped while its channel's prefetch was full: another consumer may act on it,
    # but a marker nobody pops must still end, as the one enqueue pushed does.
    waker = _waker(store, client)
    soon = store.keys("q").soon
    waker._report_soon(soon)
    assert client.llen(soon) == 1
    assert 0 < client.pttl(soon) <= 60_000
