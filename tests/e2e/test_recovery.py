"""End to end: stall recovery with real workers, SIGKILL and poison tasks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError
from celery_emq.store.jobstore import JobStore

from .harness import ROOT, Worker, run_celery, suite_app, wait_for

pytestmark = pytest.mark.slow


def runs(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(prefix + "runs").items()}


def texts(client: redis.Redis, key: str) -> list[str]:
    return [v.decode() for v in client.lrange(key, 0, -1)]


def test_sigkilled_worker_task_restarts_on_a_survivor(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    lease_ms = 5000
    # A sweep at most every third of the lease: a longer gap between passes reads as
    # an outage, and a dead worker's job then waits one more lease.
    sweep = {"EMQ_E2E_LEASE_MS": str(lease_ms), "EMQ_E2E_SWEEP_S": "1.5"}
    capp = suite_app(redis_url, prefix, lease_ms)
    doomed = start_worker("-c", "1", name="doomed", **sweep)
    result = capp.send_task("tests.e2e.app.sleepy", args=(3, "victim"))
    wait_for(lambda: runs(client, prefix).get("victim") == 1, 15)
    start_worker("-c", "1", name="survivor", **sweep)
    killed_at = time.time()
    doomed.kill()
    wait_for(lambda: runs(client, prefix).get("victim") == 2, 30)
    restarted_at = float(client.lrange(prefix + "started:victim", -1, -1)[0])
    recovery_s = restarted_at - killed_at
    print(f"\nrecovery after SIGKILL: {recovery_s:.2f} s (lease {lease_ms} ms, sweep 1.5 s)")
    assert recovery_s < 15
    assert result.get(timeout=15) == "victim"
    store = JobStore(client, prefix + "emq", lease_ms)
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}, 5
    )
    assert store.metrics("celery")["recovered"] == 1
    capp.close()


def test_killed_worker_past_budget_is_dead_lettered_by_a_survivors_sweep(
    start_worker: Callable[..., Worker], client: redis.Redis, prefix: str, redis_url: str
) -> None:
    lease_ms = 2000
    capp = suite_app(redis_url, prefix, lease_ms)
    env = {"EMQ_E2E_LEASE_MS": str(lease_ms), "EMQ_E2E_MAX_STALLED": "0", "EMQ_E2E_SWEEP_S": "0.5"}
    doomed = start_worker("-c", "1", name="doomed", **env)
    result = capp.send_task("tests.e2e.app.sleepy", args=(30, "once"))
    wait_for(lambda: runs(client, prefix).get("once") == 1, 15)
    start_worker("-c", "1", name="survivor", **env)
    doomed.kill()
    # The survivor's sweep thread finds the lapsed lease: with max_stalled=0 the
    # first stall is fatal, so the task's caller gets StalledJobError.
    with pytest.raises(StalledJobError, match="stalled 1 times"):
        result.get(timeout=30)
    assert runs(client, prefix) == {"once": 1}
    signals = {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()}
    assert signals == {f"tests.e2e.app.sleepy:{result.id}:lease_expired": 1}
    capp.close()


@pytest.mark.parametrize(
    ("task", "budget_option", "expected_runs"),
    [
        ("tests.e2e.app.poison", "1", 2),  # the default budget
        ("tests.e2e.app.poison", "3", 4),  # max_stalled=3 as a transport option
        ("tests.e2e.app.poison3", "1", 4),  # a task's own emq_max_stalled=3 wins
    ],
)
def test_poison_task_is_dead_lettered_after_its_budget(
    task: str,
    budget_option: str,
    expected_runs: int,
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
) -> None:
    start_worker("-c", "1", "-E", EMQ_E2E_MAX_STALLED=budget_option)
    store = JobStore(client, prefix + "emq", 30000)
    poisoned = capp.send_task(task, args=("p",))
    innocents = [capp.send_task("tests.e2e.app.add", args=(i, 1)) for i in range(5)]
    with pytest.raises(StalledJobError, match=f"stalled {expected_runs} times"):
        poisoned.get(timeout=60, propagate=True)
    assert [r.get(timeout=30) for r in innocents] == [1, 2, 3, 4, 5]
    assert runs(client, prefix)["p"] == expected_runs
    headers = [int(x) for x in client.lrange(prefix + "stall-header:p", 0, -1)]
    assert headers == list(range(expected_runs))
    k = store.keys("celery")
    [dead_id] = [x.decode() for x in client.zrange(k.dead, 0, -1)]
    row = store.job("celery", dead_id)
    assert (row["state"], row["stalled"], row["last_error"], row["reason"]) == (
        "dead",
        str(expected_runs),
        "stalled",
        "worker_lost",
    )
    time.sleep(1)  # nothing may run it again
    assert runs(client, prefix)["p"] == expected_runs
    signals = {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()}
    assert signals == {f"{task}:{poisoned.id}:worker_lost": 1}
    # The last innocent's ack may land just after its result.
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 1}, 10
    )


def test_two_poison_tasks_together_on_prefork_each_run_max_stalled_plus_one_times(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
) -> None:
    # Two tasks that kill their pool child, claimed together by a worker whose
    # two children run them at once: both children die at about the same time.
    # max_stalled=1: each runs twice, each run charged, then the morgue; and
    # again after `dead retry --all`.
    store = JobStore(client, prefix + "emq", 30000)
    results = {tag: capp.send_task("tests.e2e.app.poison", args=(tag,)) for tag in "ab"}
    start_worker("-P", "prefork", "-c", "2", EMQ_E2E_MAX_STALLED="1")
    buried = {"pending": 0, "active": 0, "delayed": 0, "dead": 2}
    for round_ in (1, 2):
        if round_ == 2:
            retried = run_celery(e2e_env, "emq", "dead", "retry", "--all", "--force", "--json")
            assert retried.returncode == 0, retried.stderr
            assert len(json.loads(retried.stdout)["retried"]) == 2
        wait_for(lambda: store.counts("celery") == buried, 60)
        time.sleep(1)  # nothing may run them again
        seen = runs(client, prefix)
        claims = {tag: texts(client, prefix + "claims:" + tag) for tag in "ab"}
        shown = run_celery(
            e2e_env, "emq", "dead", "show", "--json", *(r.id for r in results.values())
        )
        assert shown.returncode == 0, shown.stderr
        told = {j["task_id"]: (j["stalled"], j["deliveries"]) for j in json.loads(shown.stdout)}
        print(f"\nround {round_}: runs {seen}, (stalls, deliveries) {told}, claims {claims}")
        assert seen == {"a": 2 * round_, "b": 2 * round_}
        # Every run was under a claim of its own, and each was charged a stall.
        assert {tag: len(set(c)) for tag, c in claims.items()} == seen
        assert told == {r.id: (2, 2 * round_) for r in results.values()}
        signals = {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()}
        assert signals == {
            f"tests.e2e.app.poison:{r.id}:worker_lost": round_ for r in results.values()
        }


def test_poison_with_no_budget_keeps_being_recovered(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    w = start_worker("-c", "1")
    capp.send_task("tests.e2e.app.poison_forever", args=("f",))
    wait_for(lambda: runs(client, prefix).get("f", 0) >= 5, 60)
    w.kill()
    store = JobStore(client, prefix + "emq", 30000)
    assert store.counts("celery")["dead"] == 0
    assert store.metrics("celery")["failed"] == 0
    assert store.metrics("celery")["recovered"] >= 4


def test_beat_scheduled_sweep_recovers_a_lapsed_job(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
    tmp_path: Path,
) -> None:
    store = JobStore(client, prefix + "emq", 1000)
    # A job claimed and started by a worker that is gone: its lease lapses in 10 s.
    result = capp.send_task("tests.e2e.app.add", args=(20, 22))
    [job] = store.claim("celery", "gone-worker", now_ms=int(time.time() * 1000) + 9_000)
    assert store.start("celery", job.id, job.token).name == "OK"
    # The worker sweeps what it consumes once at start, then its sweep timer is
    # slowed to an hour: only beat can recover the job, once its lease lapsed.
    start_worker("-c", "1", EMQ_E2E_SWEEP_S="3600", EMQ_E2E_BEAT_S="1")
    keys = store.keys("celery")
    wait_for(lambda: client.hget(keys.base + "swept", "at"), 10)
    assert client.zscore(keys.active, job.id) > time.time() * 1000, "lapsed too soon"
    beat_log = tmp_path / "beat.log"
    with open(beat_log, "wb") as fh:
        beat = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.e2e.app",
                "beat",
                "-l",
                "info",
                "-s",
                str(tmp_path / "beat-schedule"),
                "--pidfile",
                str(tmp_path / "beat.pid"),
            ],
            cwd=ROOT,
            env={**__import__("os").environ, **e2e_env, "EMQ_E2E_BEAT_S": "1"},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        try:
            assert result.get(timeout=30) == 42
        finally:
            beat.terminate()
            beat.wait(10)
    assert "celery_emq.sweep" in beat_log.read_text()
    assert store.job("celery", job.id) == {}
    assert store.metrics("celery")["recovered"] == 1


def test_messages_celery_refuses_go_to_the_morgue_with_a_reason(
    start_worker: Callable[..., Worker], capp: Any, client: redis.Redis, prefix: str
) -> None:
    start_worker("-c", "1")
    store = JobStore(client, prefix + "emq", 30000)
    unknown = capp.send_task("no.such.task", args=(1,))
    with capp.producer_or_acquire() as producer:
        # No task header (so not protocol 2) and a body that is not JSON.
        producer.publish(
            b"{not json",
            routing_key="celery",
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
        )
    ok = capp.send_task("tests.e2e.app.add", args=(2, 3))
    assert ok.get(timeout=20) == 5
    wait_for(lambda: store.counts("celery")["dead"] == 2, 10)
    rows = [
        store.job("celery", j.decode()) for j in client.zrange(store.keys("celery").dead, 0, -1)
    ]
    reasons = sorted((r["reason"], r["error"].split(":")[0]) for r in rows)
    assert reasons == [("malformed", "DecodeError"), ("unknown_task", "KeyError")]
    # With acks_late the ack of `add` may land just after its result.
    wait_for(
        lambda: store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 2}, 10
    )
    signals = {k.decode(): int(v) for k, v in client.hgetall(prefix + "dead-signals").items()}
    assert sorted(signals.items()) == [
        ("None:None:malformed", 1),
        ("no.such.task:" + unknown.id + ":unknown_task", 1),
    ]
