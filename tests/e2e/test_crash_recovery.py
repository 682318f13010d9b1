"""End to end: an ordinary crash (no poison) recovers at full speed, and no suspect holds a queue.

After a SIGKILL, the dead worker's started jobs are charged a stall and its
prefetched ones become suspects (they lapsed before they started). A worker
holds one unstarted suspect at a time and claims everything else beside it,
so the replacement runs them at its full concurrency; when it is the only
worker, its first sweep recovers them (no outage grace: nobody saw Redis go).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq.store.jobstore import JobStore

from .harness import Worker, wait_for
from .test_never_started import _job_id

pytestmark = pytest.mark.slow


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def starts(client: redis.Redis, prefix: str, tag: str) -> list[float]:
    return [float(t) for t in client.lrange(prefix + "started:" + tag, 0, -1)]


def test_a_crash_without_poison_recovers_at_the_replacements_full_concurrency(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    lease_s, sweep_s = 4.0, 0.5
    env = {
        "EMQ_E2E_LEASE_MS": str(int(lease_s * 1000)),
        "EMQ_E2E_SWEEP_S": str(sweep_s),
        "EMQ_E2E_PREFETCH": "4",
    }
    w = start_worker("-P", "prefork", "-c", "4", name="crash", **env)
    tags = [f"t{i:02d}" for i in range(40)]
    results = [capp.send_task("tests.e2e.app.sleepy", args=(1, tag)) for tag in tags]
    # Two waves run; the worker holds many more claims (prefetch 4 x 4).
    wait_for(lambda: len(runs(client, prefix)) >= 8, 30)
    store = JobStore(client, prefix + "emq", int(lease_s * 1000))
    held = store.counts("celery")["active"]
    killed_at = time.time()
    w.kill()  # SIGKILL, its pool processes too: no warm shutdown, no poison
    before = {tag: n for tag, n in runs(client, prefix).items() if n}
    start_worker("-P", "prefork", "-c", "4", name="replacement", **env)
    assert [r.get(timeout=90) for r in results] == tags
    after = runs(client, prefix)
    last_start = max(starts(client, prefix, tag)[-1] for tag in tags)
    remaining = len(tags) - len(before)
    took_s = last_start - killed_at
    print(
        f"\n{held} claims held at the kill, {len(before)} started; the last task started "
        f"{took_s:.1f} s after the kill ({remaining} to run, 4 at a time)"
    )
    # Every task ran; none more than twice; one not started before the kill ran once.
    assert set(after) == set(tags)
    assert max(after.values()) <= 2
    assert all(after[tag] == 1 for tag in tags if tag not in before)
    # The recovered ones ran at full concurrency: the last start is within a
    # lease and a sweep of the kill, plus the waves the rest needed, plus slack
    # for the replacement's start; one at a time would take `remaining` seconds more.
    assert took_s <= lease_s + sweep_s + math.ceil(remaining / 4) + 4
    assert store.metrics("celery")["failed"] == 0


def test_a_sole_workers_crash_is_recovered_within_a_lease_and_a_sweep(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    lease_s, sweep_s = 4.0, 0.5
    env = {"EMQ_E2E_LEASE_MS": str(int(lease_s * 1000)), "EMQ_E2E_SWEEP_S": str(sweep_s)}
    w = start_worker("-c", "1", name="only", **env)
    result = capp.send_task("tests.e2e.app.sleepy", args=(20, "victim"))
    wait_for(lambda: runs(client, prefix).get("victim") == 1, 15)
    # Its start is on record (sent within settle_delay_ms), so its lapse is a stall.
    store = JobStore(client, prefix + "emq", int(lease_s * 1000))
    job = _job_id(store, result.id)
    wait_for(lambda: store.job("celery", job).get("started"), 5)
    # It swept its queue (and then no sweep runs until its replacement's).
    swept_at = client.hget(store.keys("celery").base + "swept", "at")
    wait_for(lambda: client.hget(store.keys("celery").base + "swept", "at") != swept_at, 5)
    killed_at = time.time()
    w.kill()
    # Its supervisor restarts it after a moment, by which time the lease has
    # lapsed: no sweep ran for over half a lease, which looks like an outage
    # from the sweeps' schedule alone.
    time.sleep(lease_s + 0.5)
    replacement = start_worker("-c", "1", name="replacement", **env)
    ready_at = time.time()
    wait_for(lambda: runs(client, prefix).get("victim") == 2, 30)
    again_at = starts(client, prefix, "victim")[-1]
    print(
        f"\nsole worker's task running again {again_at - killed_at:.2f} s after the kill, "
        f"{again_at - ready_at:.2f} s after its replacement was ready"
    )
    # A dead fleet is not an outage: recovered by the replacement's first
    # sweeps, with no extra lease of grace.
    assert again_at - ready_at <= sweep_s + 1
    assert "granted one more lease" not in replacement.text()
    row = store.job("celery", job)
    assert (row["stalled"], row["state"]) == ("1", "active")


def _suspect_waiting_for_its_eta(
    capp: Any, store: JobStore, client: redis.Redis, **opts: Any
) -> Any:
    """Publish a suspect (it lapsed once) that, claimed, waits 3 s in the worker for its ETA.

    Its job is made claimable at once (promoted as if due), so the worker
    holds it unstarted until the ETA its message carries.
    """
    suspect = capp.send_task("tests.e2e.app.sleepy", args=(0, "suspect"), countdown=3, **opts)
    [job_id] = [i.decode() for i in client.zrange(store.keys("celery").delayed, 0, -1)]
    assert store.promote("celery", 10, now_ms=int(time.time() * 1000) + 60_000) == 1
    client.hset(store.keys("celery").job(job_id), "lapsed", 1)
    return suspect


@pytest.mark.parametrize("where", ["same queue", "other queue", "other lane"])
def test_a_suspect_not_yet_started_holds_back_no_queue_and_no_lane(
    where: str,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
) -> None:
    store = JobStore(client, prefix + "emq", 4000)
    w = start_worker(
        "-P", "prefork", "-c", "2", "-Q", "celery,q2", name="busy", EMQ_E2E_LEASE_MS="4000"
    )
    lanes = where == "other lane"
    os.kill(w.proc.pid, signal.SIGSTOP)
    try:
        suspect = _suspect_waiting_for_its_eta(
            capp, store, client, **({"headers": {"emq_group": "a"}} if lanes else {})
        )
        opts: dict[str, Any] = {}
        if where == "other queue":
            opts["queue"] = "q2"
        elif lanes:
            opts["headers"] = {"emq_group": "b"}
        others = [
            capp.send_task("tests.e2e.app.sleepy", args=(0, f"o{i}"), **opts) for i in range(2)
        ]
        published = time.time()
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)
    assert [r.get(timeout=15) for r in others] == ["o0", "o1"]
    assert suspect.get(timeout=15) == "suspect"
    first = {tag: starts(client, prefix, tag)[0] for tag in ("suspect", "o0", "o1")}
    print(f"\n{where}: " + ", ".join(f"{t} +{s - published:.2f} s" for t, s in first.items()))
    # The others ran at once, not after the suspect started at its ETA.
    assert max(first["o0"], first["o1"]) - published < 2
    assert first["suspect"] - published >= 2.5
    assert max(first["o0"], first["o1"]) < first["suspect"]
    assert runs(client, prefix) == {"suspect": 1, "o0": 1, "o1": 1}
