from __future__ import annotations

import logging
import time

import pytest
import redis

from celery_emq.store.jobstore import JobStore
from celery_emq.transport.lease import Claim, LeaseKeeper, delivery_tag, parse_tag
from tests.conftest import ManualKeeper


def test_delivery_tag_names_the_job_and_the_claim() -> None:
    assert delivery_tag("a#b", "3.0f9a") == "a#b#3.0f9a"
    assert parse_tag("a#b#3.0f9a") == ("a#b", "3.0f9a")
    # A claim an earlier version made: its token is the delivery count alone.
    assert parse_tag("a#b#3") == ("a#b", "3")
    assert parse_tag("plain-id") is None
    assert parse_tag("a#x") is None
    assert parse_tag("a#3.") is None
    assert parse_tag("a#3.0F9A") is None


def test_renew_once_extends_every_held_lease(store: JobStore, client: redis.Redis) -> None:
    for i in ("a", "b", "c"):
        store.enqueue("q", i, b"{}", now_ms=1)
    claimed = store.claim("q", "me", count=3, now_ms=1000)
    k = ManualKeeper("me")
    tags = k.hold(store, "q", [(j.id, j.token) for j in claimed], interval_ms=60_000)
    assert tags == [f"{j.id}#{j.token}" for j in claimed]
    assert [t.split(".")[0] for t in tags] == ["a#1", "b#1", "c#1"]
    assert k.renew_once(now_ms=9000) == []
    for i in ("a", "b", "c"):
        assert client.zscore(store.keys("q").active, i) == 9000 + store.lease_ms


def test_lost_lease_is_reported_once_and_not_renewed(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    store.claim("q", "me", now_ms=1000)
    store.reap("q", now_ms=1000 + store.lease_ms + 1)
    store.claim("q", "someone-else", now_ms=7000)
    k = ManualKeeper("me")
    assert k.hold(store, "q", [("a", 1)], interval_ms=60_000) == ["a#1"]
    assert k.renew_once(now_ms=8000) == ["a#1"]
    assert k.is_lost("a#1")
    assert k.renew_once(now_ms=9000) == []
    assert client.zscore(store.keys("q").active, "a") == 7000 + store.lease_ms
    assert k.forget("a#1") == Claim(store, "q", "a", 1)
    assert not k.is_lost("a#1")
    assert k.held_count() == 0
    assert k.forget("a#1") is None


def test_thread_renews_on_its_own(store: JobStore, client: redis.Redis) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [job] = store.claim("q", "me", now_ms=1)  # deadline far in the past
    k = LeaseKeeper("me")
    [tag] = k.hold(store, "q", [(job.id, job.token)], interval_ms=100)
    deadline = time.monotonic() + 5
    while k.renewals < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert k.renewals >= 2
    # The new deadline is read on the Redis server's clock.
    assert client.zscore(store.keys("q").active, "a") > store.server_ms()
    k.forget(tag)


def test_a_kept_claim_nobody_will_settle_is_let_go(store: JobStore, client: redis.Redis) -> None:
    # At a channel close, a pool process had started two tasks the worker had
    # not heard of: both claims are kept. One shows up among the worker's
    # tasks; the other was dropped by Celery and would be renewed for ever.
    for i in ("seen", "lost"):
        store.enqueue("q", i, b"{}", now_ms=1)
    claimed = store.claim("q", "me", count=2, now_ms=1000)
    k = ManualKeeper("me")
    tags = k.hold(store, "q", [(j.id, j.token) for j in claimed], interval_ms=60_000)
    for j in claimed:
        store.start("q", j.id, j.token)
    for tag in tags:
        k.release(tag, unless_started=True, unseen=True)
    assert k.held_count() == 2  # started: kept
    seen, lost = tags
    assert k.let_go_of_orphans(known={seen}, after_s=3600) == []
    assert k.let_go_of_orphans(known=set(), after_s=0) == [lost]
    assert k.get(seen) is not None and k.get(lost) is None
    row = store.job("q", "lost")
    assert (row["state"], row["stalled"]) == ("pending", "0")  # uncounted: not its fault
    assert store.job("q", "seen")["state"] == "active"


def test_a_fenced_release_changes_nothing_and_says_so_once(
    store: JobStore, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store.enqueue("q", "a", b"{}", now_ms=1)
    [stale] = store.claim("q", "me", now_ms=1000)
    store.reap("q", now_ms=1000 + store.lease_ms + 1)
    [live] = store.claim("q", "other", now_ms=7000)
    k = ManualKeeper("me")
    [tag] = k.hold(store, "q", [(stale.id, stale.token)], interval_ms=60_000)
    with caplog.at_level(logging.WARNING, logger="celery_emq.transport.lease"):
        k.release(tag)
    fenced = [r for r in caplog.records if "fenced" in r.getMessage()]
    assert [r.getMessage() for r in fenced] == [
        f"celery_emq: release of {tag} fenced: another claim holds the job now; left to it"
    ]
    assert store.fenced("q") == {"release": 1}
    row = store.job("q", "a")
    assert (row["state"], row["claim"], row["owner"]) == ("active", live.token, "other")
