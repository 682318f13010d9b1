"""End to end: ``celery -A app emq ...`` against a real worker's morgue."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_emq import StalledJobError

from .harness import Worker, run_celery, wait_for

pytestmark = pytest.mark.slow


def emq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_celery(env, "emq", *args)


def test_dead_ls_lists_and_retry_runs_it(
    start_worker: Callable[..., Worker],
    capp: Any,
    client: redis.Redis,
    prefix: str,
    e2e_env: dict[str, str],
) -> None:
    start_worker("-c", "1")
    result = capp.send_task("tests.e2e.app.poison_until_cured", args=("c",))
    with pytest.raises(StalledJobError):
        result.get(timeout=60)

    listed = emq(e2e_env, "dead", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    [job] = json.loads(listed.stdout)["jobs"]
    assert (job["task_name"], job["task_id"], job["reason"], job["stalled"]) == (
        "tests.e2e.app.poison_until_cured",
        result.id,
        "worker_lost",
        2,
    )
    table = emq(e2e_env, "dead", "ls")
    assert job["id"] in table.stdout and "worker_lost" in table.stdout

    shown = emq(e2e_env, "dead", "show", job["id"])
    assert "history:" in shown.stdout and shown.stdout.count("worker_lost") >= 2
    # The Celery task id, which is what AsyncResult, logs and Flower show, works as well.
    by_task = emq(e2e_env, "dead", "show", result.id)
    assert by_task.returncode == 0, by_task.stderr
    assert f"job        {job['id']}" in by_task.stdout
    listed = emq(e2e_env, "dead", "ls", "--task-id", result.id, "--json")
    assert [j["id"] for j in json.loads(listed.stdout)["jobs"]] == [job["id"]]
    missing = emq(e2e_env, "dead", "show", "no-such-id")
    assert missing.returncode != 0
    assert "job id or Celery task id" in missing.stderr and "no-such-id" in missing.stderr

    status = json.loads(emq(e2e_env, "status", "--json").stdout)
    [celery_q] = [q for q in status["queues"] if q["queue"] == "celery"]
    assert celery_q["dead"] == 1 and celery_q["counters"]["failed"] == 1

    client.set(prefix + "cured:c", 1)
    retried = emq(e2e_env, "dead", "retry", result.id, "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout) == {"retried": [job["id"]], "missing": []}
    wait_for(lambda: client.hget(prefix + "runs", "c") == b"3", 30)
    assert json.loads(emq(e2e_env, "dead", "ls", "--json").stdout)["jobs"] == []


def test_errors_are_one_line_and_non_zero(e2e_env: dict[str, str]) -> None:
    missing = emq(e2e_env, "dead", "show", "no-such-job")
    assert missing.returncode != 0
    assert missing.stderr.strip() == (
        "Error: no dead job with job id or Celery task id 'no-such-job' in any queue's morgue"
    )
    unselected = emq(e2e_env, "dead", "retry")
    assert unselected.returncode != 0
    assert unselected.stderr.strip() == (
        "Error: name job or task ids, give a filter, or pass --all for every dead job"
    )
    bad_reason = emq(e2e_env, "dead", "ls", "--reason", "worker-lost")
    assert bad_reason.returncode != 0
    assert "'worker-lost'" in bad_reason.stderr and "worker_lost" in bad_reason.stderr
    bad_time = emq(e2e_env, "dead", "ls", "--since", "yesterday-ish")
    assert bad_time.returncode != 0 and "--since" in bad_time.stderr
    nowhere = {"EMQ_E2E_REDIS": "redis://127.0.0.1:1/0", "EMQ_E2E_BROKER": "emq://127.0.0.1:1/0"}
    wrong_broker = emq({**e2e_env, **nowhere}, "status")
    assert wrong_broker.returncode != 0
    assert len(wrong_broker.stderr.strip().splitlines()) == 1
