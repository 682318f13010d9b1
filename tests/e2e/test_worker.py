"""End to end: real ``celery worker`` processes on the emq:// transport."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import chain, chord, group

from celery_emq.store.jobstore import JobStore

from ..conftest import servers_of
from .harness import Worker, lapsed_leases, suite_app, wait_for

pytestmark = pytest.mark.slow


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def test_2000_tasks_through_prefork_each_run_once(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    start_worker("-c", "2", "-P", "prefork")
    n = 2000
    with capp.producer_or_acquire() as producer:
        for i in range(n):
            capp.send_task("tests.e2e.app.record", args=(i,), producer=producer)
    wait_for(lambda: client.hlen(prefix + "runs") == n, timeout=120, interval=0.5)
    counts = runs(client, prefix)
    assert sorted(map(int, counts)) == list(range(n))
    assert set(counts.values()) == {1}
    store = JobStore(client, prefix + "emq", 30000)
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}, 10
    )


def test_long_task_and_eta_outlive_the_lease_and_run_once(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    lease_ms = 3000
    capp = suite_app(redis_url, prefix, lease_ms)
    start_worker("-c", "2", EMQ_E2E_LEASE_MS=str(lease_ms))
    store = JobStore(client, prefix + "emq", lease_ms)
    sent_at = time.time()
    long = capp.send_task("tests.e2e.app.sleepy", args=(20, "long"))
    eta = capp.send_task("tests.e2e.app.sleepy", args=(0, "eta"), countdown=20)
    k = store.keys("celery")
    # Every second until both are done, no lease may be past its deadline.
    lapsed: list[bytes] = []
    deadline = time.monotonic() + 60
    while client.llen(prefix + "done") < 2 and time.monotonic() < deadline:
        lapsed += lapsed_leases(client, k.active)
        time.sleep(1)
    assert long.get(timeout=10) == "long"
    assert eta.get(timeout=10) == "eta"
    assert lapsed == []
    assert runs(client, prefix) == {"long": 1, "eta": 1}
    eta_started = float(client.lrange(prefix + "started:eta", 0, -1)[0])
    assert sent_at + 20 <= eta_started < sent_at + 23
    # With acks_late the ack may land just after the result.
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}, 10
    )
    capp.close()


def test_warm_shutdown_releases_unstarted_deliveries_at_once(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", 30000)
    # Published before the worker starts, so its first claim fills the prefetch
    # window (a busy worker tops it up only once half of it is free). The first
    # task runs long enough that the stop comes while it runs (a child handed
    # the next job before the stop would run that one too).
    for i in range(6):
        capp.send_task("tests.e2e.app.sleepy", args=(8 if i == 0 else 1, f"t{i}"))
    w = start_worker("-c", "1", EMQ_E2E_PREFETCH="4")
    # One task runs, the rest of the prefetch window is reserved (active leases).
    wait_for(lambda: client.hlen(prefix + "runs") == 1, 15)
    wait_for(lambda: store.counts("celery")["active"] == 4, 5)
    assert w.warm_stop() == 0
    counts = store.counts("celery")
    # The running task finished and was acked; nothing is left under a lease.
    assert counts["active"] == 0
    assert counts["pending"] == 5
    for job_id in client.zrange(store.keys("celery").pending, 0, -1):
        assert store.job("celery", job_id.decode())["stalled"] == "0"
    start_worker("-c", "2", name="w2")
    wait_for(lambda: client.llen(prefix + "done") == 6, 30)
    assert runs(client, prefix) == {f"t{i}": 1 for i in range(6)}


@pytest.mark.parametrize(
    ("pool", "task"),
    [("solo", "sleepy"), ("threads", "sleepy"), ("solo", "spin")],
)
def test_other_pools_keep_leases_of_blocking_tasks(
    pool: str,
    task: str,
    start_worker: Callable[..., Worker],
    client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    lease_ms = 1500
    capp = suite_app(redis_url, prefix, lease_ms)
    start_worker("-P", pool, "-c", "2", EMQ_E2E_LEASE_MS=str(lease_ms))
    store = JobStore(client, prefix + "emq", lease_ms)
    # A solo worker runs tasks on its event loop: the lease keeper's thread alone
    # renews the leases, also while pure-Python CPU work holds the GIL.
    results = [capp.send_task(f"tests.e2e.app.{task}", args=(5, f"{pool}{i}")) for i in range(3)]
    k = store.keys("celery")
    lapsed = 0
    deadline = time.monotonic() + 40
    while client.llen(prefix + "done") < 3 and time.monotonic() < deadline:
        lapsed += len(lapsed_leases(client, k.active))
        time.sleep(0.5)
    assert [r.get(timeout=20) for r in results] == [f"{pool}{i}" for i in range(3)]
    assert lapsed == 0
    assert set(runs(client, prefix).values()) == {1}
    capp.close()


def test_canvas_retries_eta_and_remote_control(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    start_worker("-c", "2", "-E")
    assert (
        chain(
            capp.signature("tests.e2e.app.add", (1, 2)), capp.signature("tests.e2e.app.add", (3,))
        )().get(timeout=20)
        == 6
    )
    assert group(capp.signature("tests.e2e.app.add", (i, i)) for i in range(5))().get(
        timeout=20
    ) == [0, 2, 4, 6, 8]
    header = [capp.signature("tests.e2e.app.add", (i, i)) for i in range(10)]
    assert chord(header)(capp.signature("tests.e2e.app.tsum")).get(timeout=20) == 90
    assert capp.send_task("tests.e2e.app.flaky", args=("f", 2)).get(timeout=20) == 3
    assert runs(client, prefix)["f"] == 3

    inspect = capp.control.inspect(timeout=2)
    assert list((inspect.ping() or {}).values()) == [{"ok": "pong"}]
    stats = inspect.stats() or {}
    [node_stats] = stats.values()
    assert node_stats["broker"]["transport"] == "emq"

    running = capp.send_task("tests.e2e.app.sleepy", args=(3, "busy"))
    wait_for(lambda: runs(client, prefix).get("busy") == 1, 10)
    active = inspect.active() or {}
    assert [t["id"] for ts in active.values() for t in ts] == [running.id]
    assert list((inspect.reserved() or {}).keys()) == list(stats.keys())
    later = capp.send_task("tests.e2e.app.sleepy", args=(0, "revoked"), countdown=4)

    def scheduled_ids() -> list[str]:
        return [t["request"]["id"] for ts in (inspect.scheduled() or {}).values() for t in ts]

    # Its ETA is ahead: it waits in the broker, not in the worker's schedule.
    store = JobStore(client, prefix + "emq", 30000)
    assert store.counts("celery")["delayed"] == 1
    assert scheduled_ids() == []
    capp.control.revoke(later.id)
    running.get(timeout=10)
    wait_for(lambda: later.state == "REVOKED", 10)
    time.sleep(4)
    assert "revoked" not in runs(client, prefix)
    assert store.counts("celery")["delayed"] == 0


def test_broker_reconnect_keeps_running_task_leased_and_acks_it(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    lease_ms = 2000
    capp = suite_app(redis_url, prefix, lease_ms)
    name = f"emq-reconnect-{prefix.strip(':')}"
    w = start_worker("-c", "1", EMQ_E2E_LEASE_MS=str(lease_ms), EMQ_E2E_CLIENT_NAME=name)
    store = JobStore(client, prefix + "emq", lease_ms)
    result = capp.send_task("tests.e2e.app.sleepy", args=(8, "survivor"))
    wait_for(lambda: runs(client, prefix).get("survivor") == 1, 10)
    killed = 0
    for server in servers_of(client):
        for c in server.client_list():
            if c.get("name") == name:
                server.client_kill_filter(_id=c["id"])
                killed += 1
    assert killed >= 1
    wait_for(lambda: "Connection to broker lost" in w.text(), 10)
    k = store.keys("celery")
    lapsed = 0
    deadline = time.monotonic() + 30
    while client.llen(prefix + "done") < 1 and time.monotonic() < deadline:
        lapsed += len(lapsed_leases(client, k.active))
        assert client.zcard(k.pending) == 0, "a reconnect must not requeue a running task"
        time.sleep(0.5)
    assert result.get(timeout=10) == "survivor"
    assert lapsed == 0
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}, 5
    )
    assert runs(client, prefix) == {"survivor": 1}
    capp.close()


def test_task_events_reach_a_monitor(start_worker: Callable[..., Worker], capp: Any) -> None:
    start_worker("-c", "1", "-E")
    seen: list[str] = []
    result = capp.send_task("tests.e2e.app.add", args=(2, 2))
    with capp.connection_for_read() as conn:
        recv = capp.events.Receiver(conn, handlers={"*": lambda ev: seen.append(ev["type"])})
        deadline = time.monotonic() + 15
        it = recv.itercapture(limit=None, timeout=1, wakeup=False)
        while "task-succeeded" not in seen and time.monotonic() < deadline:
            try:
                next(it)
            except (TimeoutError, StopIteration):
                pass
            if "task-succeeded" not in seen and result.ready():
                # The event may precede the receiver; send another to observe.
                result = capp.send_task("tests.e2e.app.add", args=(2, 2))
        it.close()
    assert "task-succeeded" in seen


def test_a_flooding_group_does_not_starve_another(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    """Fair lanes under a real worker: a small group's tasks run among a flood's first."""
    flood, small = 200, 10
    with capp.producer_or_acquire() as producer:
        for i in range(flood):
            capp.send_task(
                "tests.e2e.app.ledger", args=(i,), headers={"emq_group": "flood"}, producer=producer
            )
        for i in range(1000, 1000 + small):
            capp.send_task(
                "tests.e2e.app.ledger", args=(i,), headers={"emq_group": "small"}, producer=producer
            )
    store = JobStore(client, prefix + "emq", 30000)
    assert store.counts("celery")["pending"] == flood + small
    # Published behind the whole flood, and one task at a time: without lanes the
    # small group's first task would run 201st.
    start_worker("-P", "solo", EMQ_E2E_PREFETCH="1")
    wait_for(lambda: client.llen(prefix + "ledger") == flood + small, timeout=120, interval=0.5)
    order = [int(e.split()[0]) for e in client.lrange(prefix + "ledger", 0, -1)]
    assert sorted(order) == [*range(flood), *range(1000, 1000 + small)]
    small_at = [n for n, i in enumerate(order) if i >= 1000]
    # Claims rotate over the lanes one job at a time: the two groups alternate
    # until the small one is drained.
    assert small_at[-1] < 2 * small + 2, small_at
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}, 10
    )


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_task_reads_its_claim_from_the_delivery_tag_in_any_process(
    start_worker: Callable[..., Worker], capp: Any, pool: str
) -> None:
    # The claim's one carrier: the delivery tag in request.properties, which
    # Celery hands to a prefork child too. No header carries it.
    worker = start_worker("-c", "1", "-P", pool)
    got = capp.send_task("tests.e2e.app.claim_of").get(timeout=30)
    assert got["claim"] is not None
    _job_id, token = got["claim"]
    count, _, nonce = token.partition(".")
    assert (count, len(nonce)) == ("1", 16)
    # The very claim the store holds, and whose start (its delivery count) the worker recorded.
    assert got["row"] == {"claim": token, "started": "1", "deliveries": "1"}
    assert got["emq_claim"] is None
    assert (got["pid"] != worker.proc.pid) == (pool == "prefork")
