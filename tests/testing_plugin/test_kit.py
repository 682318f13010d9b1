"""celery_emq.testing's fixtures and helpers, used from this project's own tests."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_emq.testing import DEFAULT_REDIS_URL, EmqTestKit, delete_prefix, redis_url_for


def test_the_redis_url_comes_from_the_environment_then_the_ini_file() -> None:
    assert redis_url_for("redis://e/1", "redis://i/2") == "redis://e/1"
    assert redis_url_for(None, "redis://i/2") == "redis://i/2"
    assert redis_url_for("", None) == DEFAULT_REDIS_URL == "redis://127.0.0.1:6379/15"


def test_the_plugin_is_loaded_but_asks_for_nothing(request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.has_plugin("celery_emq")
    assert not [name for name in request.fixturenames if name.startswith("emq")]


def test_the_app_lives_under_the_test_prefix(emq_app: Any, emq_prefix: str) -> None:
    from celery import current_app

    assert current_app._get_current_object() is emq_app
    assert emq_app.conf.broker_url.startswith("emq://")
    assert emq_app.conf.broker_transport_options["global_keyprefix"] == emq_prefix
    assert emq_app.conf.result_backend_transport_options == {"global_keyprefix": emq_prefix}


def test_delete_prefix_deletes_only_its_own_keys(client: redis.Redis, prefix: str) -> None:
    client.mset({f"{prefix}a:{i}": 1 for i in range(1200)} | {f"{prefix}b": 1})
    assert delete_prefix(client, f"{prefix}a:") == 1200
    assert client.exists(f"{prefix}b") == 1


def _claim(emq: EmqTestKit, start: bool = True) -> tuple[str, int]:
    [job] = emq.store.claim("celery", "owner-a")
    if start:
        emq.store.start("celery", job.id, job.token)
    return job.id, job.token


def test_lapse_fences_the_holder_and_a_sweep_counts_the_stall(emq_app: Any, emq: Any) -> None:
    result = emq_app.send_task("shop.stuck", args=(1,))
    assert emq.find(result.id) is not None
    job_id, token = _claim(emq)
    assert emq.wait_started(result.id, timeout=1) == job_id

    assert emq.lapse(result.id) == job_id
    k = emq.store.keys("celery")
    assert emq.store.client.zscore(k.active, job_id) < emq.store.server_ms()
    # The holder's renewal no longer extends the lease: its claim was lost.
    assert emq.store.extend("celery", [(job_id, token)]) == [(job_id, token)]

    [report] = emq.sweep("celery")
    assert (report.recovered, report.dead) == ([job_id], [])  # max_stalled=1: once forgiven
    assert emq.store.job("celery", job_id)["stalled"] == "1"

    _claim(emq)
    emq.lapse(job_id)  # by job id too
    [report] = emq.sweep()
    assert report.dead == [job_id]
    [dead] = emq.dead(task_id=result.id)
    assert (dead.id, dead.task_name, dead.stalled, dead.args) == (job_id, "shop.stuck", 2, [1])


def test_a_lapsed_claim_that_never_started_goes_back_uncounted(emq_app: Any, emq: Any) -> None:
    result = emq_app.send_task("shop.stuck")
    job_id, _ = _claim(emq, start=False)
    with pytest.raises(TimeoutError, match="did not start"):
        emq.wait_started(result.id, timeout=0.2)
    emq.lapse(result.id)
    emq.sweep()
    job = emq.store.job("celery", job_id)
    assert (job["state"], job["stalled"]) == ("pending", "0")
    assert emq.dead() == []


def test_lapse_of_a_job_that_is_not_live_says_why(emq_app: Any, emq: Any) -> None:
    with pytest.raises(LookupError, match="acks_late"):
        emq.lapse("no-such-task")
    result = emq_app.send_task("shop.stuck")
    with pytest.raises(LookupError, match="not active"):
        emq.lapse(result.id)  # pending: nothing holds it
