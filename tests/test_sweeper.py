"""The sweep's Python side: signals, the failure result, the task-failed event, retention."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import pytest
import redis
from celery import Celery

from celery_emq import EmqOptions, StalledJobError
from celery_emq.signals import job_dead_lettered, job_recovered, job_stalled
from celery_emq.store.jobstore import JobStore
from celery_emq.store.outcomes import Outcome
from celery_emq.transport import lease
from celery_emq.transport.jobs import JobInfo
from celery_emq.transport.lease import delivery_tag
from celery_emq.transport.sweep_thread import SweepThread
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker import state as worker_state
from celery_emq.worker.follow_up import CeleryFollowUp
from tests.conftest import ManualKeeper, sweeps_ran_until, token_of
from tests.e2e.harness import wait_for


@pytest.fixture
def captured() -> Iterator[dict[str, list[JobInfo]]]:
    got: dict[str, list[JobInfo]] = {"stalled": [], "recovered": [], "dead": []}

    def on(kind: str) -> Any:
        def handler(sender: Any, job: JobInfo, **kw: Any) -> None:
            got[kind].append(job)

        return handler

    handlers = {"stalled": on("stalled"), "recovered": on("recovered"), "dead": on("dead")}
    job_stalled.connect(handlers["stalled"])
    job_recovered.connect(handlers["recovered"])
    job_dead_lettered.connect(handlers["dead"])
    yield got
    job_stalled.disconnect(handlers["stalled"])
    job_recovered.disconnect(handlers["recovered"])
    job_dead_lettered.disconnect(handlers["dead"])


def lapse_one(app: Celery, store: JobStore, now_ms: int, started: bool = True) -> tuple[Any, str]:
    """Publish a task and claim it at ``now_ms``; with ``started``, its task starts."""
    result = app.send_task("proj.tasks.poison", args=(1, "x"), kwargs={"k": 2})
    [job] = store.claim("celery", "w1", now_ms=now_ms)
    if started:
        assert store.start("celery", job.id, job.token) is Outcome.OK
    return result, job.id


def failures_stored(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Note every failure the app's result backend is asked to store: (task id, error)."""
    stored: list[tuple[str, Any]] = []
    mark = app.backend.mark_as_failure

    def noting(task_id: str, exc: Any, *args: Any, **kwargs: Any) -> Any:
        stored.append((task_id, exc))
        return mark(task_id, exc, *args, **kwargs)

    monkeypatch.setattr(app.backend, "mark_as_failure", noting)
    return stored


@pytest.fixture
def no_worker_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process runs no worker (a test may have run one in-process before)."""
    monkeypatch.setattr(worker_state, "_nodename", None)


@pytest.mark.usefixtures("no_worker_here")
def test_dead_letter_fires_signals_stores_failure_and_sends_event(
    app: Celery, client: redis.Redis, prefix: str, captured: dict[str, list[JobInfo]]
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=1), CeleryFollowUp(app))
    result, job_id = lapse_one(app, store, 1000)
    assert sweeper.sweep("celery", now_ms=7000).recovered == [job_id]
    # The last holder is a started worker: its lease owner carries its node name.
    [again] = store.claim("celery", "w2@host:42:abc", now_ms=8000)
    store.start("celery", again.id, again.token)
    events: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        recv = app.events.Receiver(conn, handlers={"task-failed": events.append})
        it = recv.itercapture(limit=None, timeout=2, wakeup=False)
        try:
            next(it)  # declare the event queue before the sweep sends
        except (TimeoutError, StopIteration):
            pass
        sweeps_ran_until(store, "celery", 13_999)
        report = sweeper.sweep("celery", now_ms=14_000)
        assert report.dead == [job_id]
        for _ in range(5):
            if events:
                break
            try:
                next(it)
            except (TimeoutError, StopIteration):
                pass
        it.close()

    assert [j.stalled for j in captured["stalled"]] == [1, 2]
    assert [j.id for j in captured["recovered"]] == [job_id]
    [dead] = captured["dead"]
    assert (dead.task_name, dead.task_id, dead.args, dead.kwargs) == (
        "proj.tasks.poison",
        result.id,
        [1, "x"],
        {"k": 2},
    )
    assert (dead.queue, dead.stalled, dead.reason) == ("celery", 2, "lease_expired")
    with pytest.raises(StalledJobError, match="stalled 2 times") as err:
        result.get(timeout=5)
    # The text names the job id that `celery emq dead` and the Morgue API list.
    assert f"job {job_id}" in str(err.value)
    assert [e["uuid"] for e in events] == [result.id]
    assert f"job {job_id}" in events[0]["exception"]
    # Reported from the worker that last held the task, not from a made-up node.
    assert [e["hostname"] for e in events] == ["w2@host"]


@pytest.mark.usefixtures("no_worker_here")
def test_failure_node_is_the_sweeping_worker_or_the_last_holder_or_none(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    info = JobInfo(id="j", queue="celery")
    k = store.keys("celery")
    follow_up = CeleryFollowUp(app)
    sweeper = Sweeper(store, EmqOptions(), follow_up)

    def node() -> str | None:
        return follow_up.failure_node(partial(sweeper.last_holder, info))

    assert CeleryFollowUp(app, node="beat@h").failure_node(lambda: "w9@h") == "beat@h"
    assert node() is None  # nothing known: no event at all
    history = [{"owner": "w1@h:1:a"}, {"owner": "h:2:b"}, {"owner": "w3@h:3:c"}]
    client.hset(k.job("j"), "history", json.dumps(history))
    assert node() == "w3@h"
    client.hset(k.job("j"), "history", json.dumps(history[:2]))
    assert node() == "w1@h"  # a holder that was no worker is skipped


def test_a_raising_handler_never_breaks_the_sweep(
    app: Celery, client: redis.Redis, prefix: str, captured: dict[str, list[JobInfo]]
) -> None:
    def boom(sender: Any, **kw: Any) -> None:
        raise RuntimeError("handler bug")

    job_dead_lettered.connect(boom)
    try:
        store = JobStore(client, prefix + "emq", 5000)
        sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app))
        _, a = lapse_one(app, store, 1000)
        second, b = lapse_one(app, store, 1000)
        report = sweeper.sweep("celery", now_ms=7000)
    finally:
        job_dead_lettered.disconnect(boom)
    assert sorted(report.dead) == sorted([a, b])
    assert len(captured["dead"]) == 2
    with pytest.raises(StalledJobError):
        second.get(timeout=5)


def test_retention_applies_as_jobs_die(app: Celery, client: redis.Redis, prefix: str) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0, dead_max_size=3), CeleryFollowUp(app))
    for _ in range(5):
        lapse_one(app, store, 1000)
    report = sweeper.sweep("celery", now_ms=7000)
    assert len(report.dead) == 5 and report.trimmed == 2
    assert store.counts("celery")["dead"] == 3


def test_a_dead_job_leaves_by_the_next_sweep_when_no_other_job_dies(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0, dead_max_age_s=60), CeleryFollowUp(app))
    lapse_one(app, store, 1000)
    assert len(sweeper.sweep("celery", now_ms=7000).dead) == 1
    # Sweeps keep running while no job dies: the one past its age goes.
    assert sweeper.sweep("celery", now_ms=7000 + 60_000).trimmed == 0
    report = sweeper.sweep("celery", now_ms=7000 + 60_001)
    assert report.trimmed == 1 and report.dead == []
    assert store.counts("celery")["dead"] == 0


def test_a_lapse_before_the_task_started_sends_no_signal_and_records_no_failure(
    app: Celery, client: redis.Redis, prefix: str, captured: dict[str, list[JobInfo]]
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app))
    result, job_id = lapse_one(app, store, 1000, started=False)
    report = sweeper.sweep("celery", now_ms=7000)
    assert (report.requeued, report.recovered, report.dead) == ([job_id], [], [])
    assert captured == {"stalled": [], "recovered": [], "dead": []}
    assert store.counts("celery") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    assert result.state == "PENDING"


def test_malformed_job_is_described_not_raised() -> None:
    from celery_emq.transport.jobs import describe

    info = describe(b"{not json", "q", "id1", 2, "lease_expired")
    assert info.task_name is None
    assert info.decode_error is not None and "JSONDecodeError" in info.decode_error


def test_a_sweep_renews_its_own_processs_claims_before_it_counts_stalls(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    captured: dict[str, list[JobInfo]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every thread of a process can be held up longer than a lease: a C call that
    # keeps the GIL, a greenlet that blocks a gevent hub. When the process runs
    # again its sweep thread may get there before its lease keeper. The claims
    # the process holds are alive, so its own sweep must not count them stalled.
    store = JobStore(client, prefix + "emq", 5000)
    _, theirs = lapse_one(app, store, 1000)
    _, mine = lapse_one(app, store, 1000)
    keeper = ManualKeeper("me")  # renews only when asked: it never ran
    monkeypatch.setattr(lease, "_keeper", keeper)  # the process-wide keeper
    token = token_of(store, "celery", mine)
    keeper.hold(store, "celery", [(mine, token)], interval_ms=1000)
    sweeps = SweepThread()
    sweeps.watch(Sweeper(store, EmqOptions(sweep_interval_s=3600), CeleryFollowUp(app)), "celery")
    later = 1000 + 3 * store.lease_ms
    [report] = sweeps.run_once(now_ms=later)
    assert (report.recovered, report.dead, report.requeued) == ([theirs], [], [])
    assert [j.id for j in captured["stalled"]] == [theirs]
    row = store.job("celery", mine)
    assert (row["state"], row["stalled"]) == ("active", "0")
    assert client.zscore(store.keys("celery").active, mine) == later + store.lease_ms
    assert not keeper.is_lost(delivery_tag(mine, token))


def test_a_sweep_skips_its_pass_when_its_own_claims_cannot_be_renewed(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    captured: dict[str, list[JobInfo]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    _, theirs = lapse_one(app, store, 1000)
    _, mine = lapse_one(app, store, 1000)

    class Failing(ManualKeeper):
        def renew_once(self, now_ms: int | None = None) -> list[str]:
            raise redis.ConnectionError("renewal failed")

    keeper = Failing("me")
    monkeypatch.setattr(lease, "_keeper", keeper)
    keeper.hold(store, "celery", [(mine, token_of(store, "celery", mine))], interval_ms=1000)
    sweeps = SweepThread()
    sweeps.watch(Sweeper(store, EmqOptions(sweep_interval_s=3600), CeleryFollowUp(app)), "celery")
    assert sweeps.run_once(now_ms=1000 + 3 * store.lease_ms) == []
    assert captured["stalled"] == []
    assert store.job("celery", mine)["stalled"] == "0"
    assert store.job("celery", theirs)["stalled"] == "0"


@pytest.mark.usefixtures("no_worker_here")
def test_a_dead_letter_of_a_task_that_succeeded_keeps_its_success_and_sends_no_failure(
    app: Celery, client: redis.Redis, prefix: str, captured: dict[str, list[JobInfo]]
) -> None:
    # The server lost the ack of a finished task with its last writes (a restart
    # from a snapshot, a failover): the job is back as a started claim that
    # lapses, and a job that stalled before is dead-lettered by the sweep.
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app))
    done, done_id = lapse_one(app, store, 1000)
    failed, failed_id = lapse_one(app, store, 1000)
    app.backend.mark_as_done(done.id, 42)
    report = sweeper.sweep("celery", now_ms=7000)
    assert sorted(report.dead + report.completed) == sorted([done_id, failed_id])
    assert (report.dead, report.completed) == ([failed_id], [done_id])
    assert (done.state, done.get(timeout=5)) == ("SUCCESS", 42)
    assert [j.task_id for j in captured["dead"]] == [failed.id]
    with pytest.raises(StalledJobError):
        failed.get(timeout=5)
    # A job that completed is not left in the morgue.
    assert client.zrange(store.keys("celery").dead, 0, -1) == [failed_id.encode()]
    assert store.job("celery", done_id) == {}


def counted(store: JobStore, queue: str) -> dict[str, int]:
    """The queue's completed, failed and stalled counters."""
    metrics = store.metrics(queue)
    return {name: metrics[name] for name in ("completed", "failed", "stalled")}


@pytest.mark.usefixtures("no_worker_here")
def test_a_never_started_dead_letter_over_a_success_is_a_completion(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    captured: dict[str, list[JobInfo]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fast task's start record and its ack, lost together with the server's last
    # writes: the job looks as if it never started, and with max_lapsed=0 its first
    # lapse retires it. Its SUCCESS is in the backend: no failure, no signal.
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0, max_lapsed=0), CeleryFollowUp(app))
    failures = failures_stored(app, monkeypatch)
    done, job_id = lapse_one(app, store, 1000, started=False)
    app.backend.mark_as_done(done.id, 42)
    report = sweeper.sweep("celery", now_ms=7000)
    assert (report.dead, report.completed, report.requeued) == ([], [job_id], [])
    assert captured == {"stalled": [], "recovered": [], "dead": []}
    assert failures == []
    assert (done.state, done.get(timeout=5)) == ("SUCCESS", 42)
    assert counted(store, "celery") == {"completed": 1, "failed": 0, "stalled": 0}
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert store.job("celery", job_id) == {}


def test_a_succeeded_job_the_sweep_retires_is_counted_completed_not_failed_nor_stalled(
    app: Celery, client: redis.Redis, prefix: str
) -> None:
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app))
    done, _ = lapse_one(app, store, 1000)
    app.backend.mark_as_done(done.id, 1)
    assert len(sweeper.sweep("celery", now_ms=7000).completed) == 1
    assert counted(store, "celery") == {"completed": 1, "failed": 0, "stalled": 0}
    # The same when its pool process is lost and the stall charged at once.
    again, job_id = lapse_one(app, store, 8000)
    app.backend.mark_as_done(again.id, 2)
    swept = sweeper.charge("celery", job_id, token_of(store, "celery", job_id), "worker_lost", 0)
    assert swept is not None and swept.outcome == "completed"
    assert counted(store, "celery") == {"completed": 2, "failed": 0, "stalled": 0}
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}
    assert client.hgetall(store.keys("celery").metrics("failed")) == {}


@pytest.mark.usefixtures("no_worker_here")
def test_a_sweeper_dying_before_it_asks_the_backend_leaves_no_succeeded_job_in_the_morgue(
    app: Celery, client: redis.Redis, prefix: str, captured: dict[str, list[JobInfo]]
) -> None:
    # The sweeping process dies between the script and the backend's answer: only
    # the script step ran. The job is not in the morgue (where `dead retry` would run
    # it again) nor counted; the next pass finds it again, counts nothing twice, and
    # learns that its task succeeded.
    store = JobStore(client, prefix + "emq", 5000)
    k = store.keys("celery")
    done, job_id = lapse_one(app, store, 1000)
    app.backend.mark_as_done(done.id, 42)
    for now_ms in (7000, 7500):  # the dying pass, then a second that dies too
        [swept] = store.scripts.sweep(k, now_ms, 100, 0, "lease_expired", store.lease_ms)
        assert client.zcard(k.dead) == 0
        assert (swept.id, swept.outcome, swept.stalled) == (job_id, "doomed", 1)
        assert client.zscore(k.active, job_id) == 6000  # still lapsed: found again
        row = store.job("celery", job_id)
        assert (row["state"], row["stalled"], row["doomed"]) == ("active", "1", row["claim"])
        assert counted(store, "celery") == {"completed": 0, "failed": 0, "stalled": 0}
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app))
    report = sweeper.sweep("celery", now_ms=8000)
    assert (report.dead, report.completed) == ([], [job_id])
    assert captured == {"stalled": [], "recovered": [], "dead": []}
    assert counted(store, "celery") == {"completed": 1, "failed": 0, "stalled": 0}
    assert store.counts("celery") == {"pending": 0, "active": 0, "delayed": 0, "dead": 0}


@pytest.mark.usefixtures("no_worker_here")
def test_an_older_success_of_a_reused_task_id_is_not_this_jobs(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    captured: dict[str, list[JobInfo]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A caller may name its tasks (`task_id="report-2026-12-04"`) and name one again:
    # the SUCCESS of the earlier task, an hour old, is not the success of this job,
    # which really died. It is dead-lettered and its failure told.
    store = JobStore(client, prefix + "emq", 5000)
    sweeper = Sweeper(store, EmqOptions(max_stalled=0), CeleryFollowUp(app))
    an_hour_ago = datetime.now(timezone.utc) - timedelta(hours=1)
    with monkeypatch.context() as m:
        m.setattr(app, "now", lambda: an_hour_ago)
        app.backend.mark_as_done("report-1", "yesterday's")
    failures = failures_stored(app, monkeypatch)
    app.send_task("proj.tasks.poison", task_id="report-1")
    [job] = store.claim("celery", "w1", now_ms=1000)
    assert store.start("celery", job.id, job.token) is Outcome.OK
    report = sweeper.sweep("celery", now_ms=7000)
    assert (report.dead, report.completed) == ([job.id], [])
    assert [j.task_id for j in captured["dead"]] == ["report-1"]
    # Told to the backend (Celery's key-value backends keep a SUCCESS they hold).
    assert [(task_id, type(exc)) for task_id, exc in failures] == [("report-1", StalledJobError)]
    assert client.zrange(store.keys("celery").dead, 0, -1) == [job.id.encode()]
    assert store.metrics("celery")["failed"] == 1


def test_a_success_is_this_jobs_if_stored_after_its_publish_give_or_take_a_second(
    app: Celery,
) -> None:
    # The result's date_done (the worker's clock) against the job's enqueued_ms (the
    # Redis server's): a second allows for clocks that disagree a little.
    follow_up = CeleryFollowUp(app)
    info = JobInfo(id="j", queue="celery", task_id="t1")
    app.backend.mark_as_done("t1", 1)
    done_ms = int(app.AsyncResult("t1").date_done.timestamp() * 1000)
    assert follow_up.succeeded(info, None) is True
    assert follow_up.succeeded(info, done_ms + 1000) is True
    assert follow_up.succeeded(info, done_ms + 1001) is False
    assert follow_up.succeeded(info, done_ms - 60_000) is True
    assert follow_up.succeeded(JobInfo(id="j", queue="celery", task_id="t2"), None) is False


def test_an_rpc_result_is_not_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # An RPC result is a message to the caller's reply queue: the sweep cannot
    # read it, and must not consume the sweeping process's own replies trying.
    rpc = Celery("rpc", broker="memory://", backend="rpc://", set_as_current=False)
    read: list[str] = []
    monkeypatch.setattr(
        type(rpc.backend), "get_task_meta", lambda _b, task_id, **kw: read.append(task_id)
    )
    assert CeleryFollowUp(rpc).succeeded(JobInfo(id="j", queue="celery", task_id="t")) is False
    assert read == []


def test_no_failure_is_sent_to_an_rpc_reply_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweep does not know the caller's reply queue: an RPC backend would take
    # the current task's (a sweep task's caller), so nothing is stored there.
    rpc = Celery("rpc", broker="memory://", backend="rpc://", set_as_current=False)
    stored = failures_stored(rpc, monkeypatch)
    CeleryFollowUp(rpc, node="w@h").failed(JobInfo(id="j", queue="celery", task_id="t"), str)
    assert stored == []


def script_calls(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the scripts ``store`` runs from now on, in order (a call once)."""
    calls: list[str] = []
    run = type(store.scripts).run

    def counted(self: Any, name: str, keys: Any, args: Any) -> Any:
        calls.append(name)
        return run(self, name, keys, args)

    monkeypatch.setattr(type(store.scripts), "run", counted)
    return calls


def test_a_pass_over_an_idle_queue_is_one_script_call_and_promotes_due_jobs(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle worker sweeps every few seconds: one call per queue, nothing beside it.
    calls = script_calls(store, monkeypatch)
    sweeper = Sweeper(store, EmqOptions())
    sweeper.sweep("celery")
    assert calls == ["sweep"]
    now = store.server_ms()
    store.enqueue("celery", "due", b"{}", eta_ms=now + 50)
    store.enqueue("celery", "later", b"{}", eta_ms=now + 600_000)
    calls.clear()
    sweeper.sweep("celery", now_ms=now + 100)
    assert calls == ["sweep"]
    assert store.counts("celery") == {"pending": 1, "active": 0, "delayed": 1, "dead": 0}


def test_the_expiry_pass_runs_only_when_the_sweep_saw_expiring_queues(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On one server the sweep script reads the x-expires registry's size: an
    # idle worker with no such queue sends nothing beside its sweep.
    if not store.one_server:
        pytest.skip("on a Cluster the expiry pass runs every time")
    expired: list[int] = []
    expire = Sweeper.expire

    def counted(self: Sweeper) -> dict[str, int]:
        if self.store is store:  # not another test's sweeper in the process-wide thread
            expired.append(1)
        return expire(self)

    monkeypatch.setattr(Sweeper, "expire", counted)
    sweeps = SweepThread()
    sweeps.watch(Sweeper(store, EmqOptions(sweep_interval_s=3600)), "celery")
    sweeps.run_once()
    time.sleep(0.3)  # a pass would have started on its lane by now
    assert expired == []
    store.note_expiring("reply-q")
    sweeps.run_once()
    for _ in range(50):
        if expired:
            break
        time.sleep(0.05)
    assert expired == [1]


def test_the_sweep_thread_promotes_a_job_when_it_falls_due_between_passes(
    store: JobStore, client: redis.Redis
) -> None:
    # The consumer that learned a delayed job's due time may be busy when it
    # comes: the process's sweep, told of the time, promotes it then, not at
    # its next regular pass.
    thread = SweepThread()
    thread.watch(Sweeper(store, EmqOptions(sweep_interval_s=30, lease_ms=120_000)), "q")
    now_ms = int(client.time()[0]) * 1000
    store.enqueue("q", "a", b"{}", eta_ms=now_ms + 1500)
    thread.due_in(1.5)
    deadline = time.monotonic() + 6
    while store.counts("q")["pending"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.counts("q") == {"pending": 1, "active": 0, "delayed": 0, "dead": 0}
    assert client.llen(store.keys("q").wake) == 1
    thread.unwatch_store(store)


def test_the_replacement_of_a_dead_fleet_recovers_at_once_and_a_cut_off_sweeper_grants_grace(
    app: Celery,
    client: redis.Redis,
    prefix: str,
    captured: dict[str, list[JobInfo]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The only worker swept at 1000 and died; its claim lapses at 6000. Nobody
    # swept for 8 s, so the sweeps' own schedule looks like an outage; but the
    # replacement's sweep thread has no pass behind it and vouches for none.
    monkeypatch.setattr(lease, "_keeper", ManualKeeper("me"))
    store = JobStore(client, prefix + "emq", 5000)
    options = EmqOptions(sweep_interval_s=3600)
    _, dead_workers = lapse_one(app, store, 1000)
    sweeps_ran_until(store, "celery", 1000)
    replacement = SweepThread()
    replacement.watch(Sweeper(store, options, CeleryFollowUp(app)), "celery")
    [report] = replacement.run_once(now_ms=9000)
    assert (report.recovered, report.graced) == ([dead_workers], [])
    # A sweep thread that swept before and was then cut off for 8 s vouches
    # for the gap: a lapse in it is granted one more lease, uncounted.
    _, live_workers = lapse_one(app, store, 9000)
    assert replacement.run_once(now_ms=9100)[0].graced == []
    [report] = replacement.run_once(now_ms=17_100)
    assert (report.recovered, report.graced) == ([], [live_workers])
    # So does one whose first pass failed (it started while Redis was away).
    failing = SweepThread()
    broken = JobStore(redis.Redis(port=1, socket_connect_timeout=0.2), prefix + "emq", 5000)
    failing.watch(Sweeper(broken, options, CeleryFollowUp(app)), "celery")
    assert failing.run_once(now_ms=30_000) == []
    assert failing.contact.since(prefix + "emq", "celery") == "0"
    assert replacement.contact.since(prefix + "emq", "celery") == "17100"


def test_a_queue_a_consumer_starts_watching_is_swept_at_once_not_an_interval_later(
    store: JobStore, client: redis.Redis
) -> None:
    # The first pass is the process's first contact on the queue: a pause that
    # begins before an interval passed is then seen as an outage, not a dead
    # fleet (CLIENT PAUSE right after the workers started had run jobs twice).
    thread = SweepThread()
    sweeper = Sweeper(store, EmqOptions(sweep_interval_s=30, lease_ms=120_000))
    thread.watch(sweeper, "q", at_once=True)
    wait_for(lambda: thread.contact.since(store.prefix, "q") not in ("", "0"), 3, 0.02)
    # Watching it again asks for no pass of its own.
    met = thread.contact.since(store.prefix, "q")
    thread.watch(sweeper, "q", at_once=True)
    time.sleep(0.3)
    assert thread.contact.since(store.prefix, "q") == met
    thread.unwatch_store(store)


def test_a_pass_over_twenty_idle_queues_is_one_call_and_a_lapsed_one_is_still_swept(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An idle worker's cost does not grow with its queues: one look, and a sweep
    # only where there is work; the look counts as the process's contact.
    monkeypatch.setattr(lease, "_keeper", ManualKeeper("me"))
    calls = script_calls(store, monkeypatch)
    thread = SweepThread()
    sweeper = Sweeper(store, EmqOptions(sweep_interval_s=3600, lease_ms=5000))
    queues = [f"q{i}" for i in range(20)]
    for q in queues:
        thread.watch(sweeper, q)
    now = store.server_ms()
    thread.run_once(now_ms=now)  # the first pass: every queue's own sweep
    assert calls.count("sweep") == 20
    calls.clear()
    thread.run_once(now_ms=now + 1000)
    assert calls == ["look"]
    assert thread.contact.since(store.prefix, "q7") == str(now + 1000)
    store.enqueue("q7", "j", b"{}", now_ms=now + 1000)
    store.claim("q7", "gone", now_ms=now + 1000)
    for at in (now + 3000, now + 5000):
        thread.run_once(now_ms=at)  # passes within half a lease: no gap to judge
    calls.clear()
    [report] = [r for r in thread.run_once(now_ms=now + 6500) if r.queue == "q7"]
    assert calls == ["look", "sweep"] and report.requeued == ["j"]
    thread.unwatch_store(store)
