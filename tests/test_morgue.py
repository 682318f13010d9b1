"""The Morgue API over real dead-lettered Celery messages."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_emq import Morgue, UnknownJobError
from celery_emq.store.jobstore import JobStore
from tests.conftest import sweeps_ran_until


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> JobStore:
    return JobStore(client, prefix + "emq", 5000)


def kill(
    app: Celery,
    store: JobStore,
    task: str,
    queue: str = "celery",
    when_ms: int = 10_000,
    **options: Any,
) -> str:
    """Publish ``task``, claim it, and let a sweep dead-letter it at ``when_ms``."""
    app.send_task(task, args=(1,), queue=queue, **options)
    [job] = store.claim(queue, "w", now_ms=when_ms - 6000)
    store.start(queue, job.id, job.token)
    store.register(queue)
    sweeps_ran_until(store, queue, when_ms - 1)
    [swept] = store.sweep(queue, max_stalled=0, now_ms=when_ms)
    assert swept.outcome == "dead"
    return job.id


def test_ls_filters_and_orders_by_death(app: Celery, store: JobStore) -> None:
    a = kill(app, store, "proj.a", when_ms=10_000)
    b = kill(app, store, "proj.b", when_ms=20_000)
    c = kill(app, store, "proj.a", queue="other", when_ms=30_000)
    store.enqueue("celery", "bad", b"{not json")
    store.bury("celery", "bad", 0, "malformed", "JSONDecodeError", now_ms=40_000)
    morgue = Morgue(store)
    assert [j.id for j in morgue.ls()] == [a, b, c, "bad"]
    assert [j.id for j in morgue.ls(task="proj.a")] == [a, c]
    assert [j.id for j in morgue.ls(queue="other")] == [c]
    assert [j.id for j in morgue.ls(reason="malformed")] == ["bad"]
    assert [j.id for j in morgue.ls(reason="stalled")] == [a, b, c]
    assert [j.id for j in morgue.ls(since_ms=15_000, until_ms=30_000)] == [b, c]
    assert [j.id for j in morgue.ls(limit=2)] == [a, b]
    [bad] = morgue.ls(reason="malformed")
    assert bad.task_name is None and bad.decode_error


def test_show_has_the_task_and_history(app: Celery, store: JobStore) -> None:
    a = kill(app, store, "proj.a")
    job = Morgue(store).show(a)
    assert job is not None
    assert (job.task_name, job.args, job.kwargs, job.queue) == ("proj.a", [1], {}, "celery")
    assert (job.stalled, job.reason, job.last_error, job.died_ms) == (
        1,
        "lease_expired",
        "stalled",
        10_000,
    )
    assert [h["reason"] for h in job.history] == ["lease_expired"]
    assert Morgue(store).show("nope") is None


def test_retry_by_id_resets_stalls_and_goes_to_the_front(
    app: Celery, store: JobStore, client: redis.Redis
) -> None:
    a = kill(app, store, "proj.a")
    app.send_task("proj.waiting", args=(2,))
    assert Morgue(store).retry([a]) == [a]
    k = store.keys("celery")
    assert client.zrange(k.pending, 0, 0) == [a.encode()]
    row = store.job("celery", a)
    assert (row["state"], row["stalled"]) == ("pending", "0")
    assert client.zcard(k.dead) == 0
    [again] = store.claim("celery", "w", now_ms=99_000)
    assert again.id == a and again.stalled == 0
    assert store.metrics("celery")["retried"] == 1


def test_retry_of_a_grouped_job_returns_it_to_its_lane(
    app: Celery, store: JobStore, client: redis.Redis
) -> None:
    a = kill(app, store, "proj.a", headers={"emq_group": "t1"})
    assert Morgue(store).retry([a]) == [a]
    assert client.zrange(store.keys("celery").lane("t1"), 0, -1) == [a.encode()]


def test_retry_by_filter_is_paced(
    app: Celery, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [kill(app, store, "proj.a") for _ in range(250)]
    kill(app, store, "proj.b")
    pauses: list[float] = []
    # time.sleep is the time module's: other threads of the process (a watcher
    # left by an earlier test) keep sleeping for real, only this one's are recorded.
    caller, sleep = threading.get_ident(), time.sleep

    def pause(seconds: float) -> None:
        if threading.get_ident() == caller:
            pauses.append(seconds)
        else:
            sleep(seconds)

    monkeypatch.setattr("celery_emq.ops.morgue.time.sleep", pause)
    retried = Morgue(store).retry(task="proj.a", rate_per_s=100)
    assert sorted(retried) == sorted(ids)
    assert len(pauses) == 2 and all(0.5 < p <= 1.0 for p in pauses)
    assert [j.task_name for j in Morgue(store).ls()] == ["proj.b"]


def test_purge_by_id_filter_and_age(app: Celery, store: JobStore, client: redis.Redis) -> None:
    a = kill(app, store, "proj.a", when_ms=10_000)
    kill(app, store, "proj.b", when_ms=20_000)
    kill(app, store, "proj.c", when_ms=30_000)
    morgue = Morgue(store)
    assert morgue.purge([a]) == 1
    assert not client.exists(store.keys("celery").job(a))
    assert morgue.purge(task="proj.c") == 1
    assert morgue.purge(until_ms=25_000) == 1
    assert morgue.ls() == []


def test_a_celery_task_id_finds_the_dead_job(
    app: Celery, store: JobStore, client: redis.Redis
) -> None:
    a = kill(app, store, "proj.a", when_ms=10_000)
    b = kill(app, store, "proj.b", queue="other", when_ms=20_000)
    morgue = Morgue(store)
    task_a, task_b = (morgue.show(a).task_id, morgue.show(b).task_id)  # type: ignore[union-attr]
    assert task_a and task_b and task_a != a
    # show, ls, retry and purge take the task id that AsyncResult, logs and Flower give.
    shown = morgue.show(task_b)
    assert shown is not None and (shown.id, shown.queue) == (b, "other")
    assert [j.id for j in morgue.ls(task_id=task_a)] == [a]
    found, missing = morgue.find([task_a, b, "nope"])
    assert ({i: j.id for i, j in found.items()}, missing) == ({task_a: a, b: b}, ["nope"])
    assert morgue.retry([task_a]) == [a]
    assert client.zrange(store.keys("celery").pending, 0, 0) == [a.encode()]
    assert morgue.purge([task_b]) == 1
    assert morgue.ls() == []


def snapshot(client: redis.Redis, prefix: str) -> dict[bytes, Any]:
    """Every key under ``prefix`` with its type and contents: what "nothing changed" compares."""
    out: dict[bytes, Any] = {}
    for key in sorted(client.scan_iter(match=prefix + "*", count=1000)):
        kind = client.type(key)
        if kind == b"zset":
            out[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"hash":
            out[key] = client.hgetall(key)
        elif kind == b"list":
            out[key] = client.lrange(key, 0, -1)
        elif kind == b"set":
            out[key] = sorted(client.smembers(key))
        else:
            out[key] = client.get(key)
    return out


@pytest.fixture
def two_dead(app: Celery, store: JobStore) -> tuple[str, str]:
    """Two dead jobs: one in queue ``celery``, one in queue ``other``."""
    return (
        kill(app, store, "proj.a", when_ms=10_000),
        kill(app, store, "proj.b", queue="other", when_ms=20_000),
    )


@pytest.mark.parametrize("verb", ["retry", "purge"])
@pytest.mark.parametrize(
    "ids",
    [["nope"], ["KNOWN", "nope"], ["KNOWN", "OTHER", "nope", "nada"]],
    ids=["unknown", "mixed", "mixed-queues"],
)
def test_an_unknown_id_changes_nothing_and_is_named(
    app: Celery,
    store: JobStore,
    client: redis.Redis,
    prefix: str,
    two_dead: tuple[str, str],
    verb: str,
    ids: list[str],
) -> None:
    a, b = two_dead
    ids = [{"KNOWN": a, "OTHER": b}.get(i, i) for i in ids]
    before = snapshot(client, prefix)
    with pytest.raises(UnknownJobError) as raised:
        getattr(Morgue(store), verb)(ids)
    assert raised.value.missing == [i for i in ids if i in ("nope", "nada")]
    assert "nope" in str(raised.value) and "nothing" in str(raised.value)
    assert snapshot(client, prefix) == before


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_an_empty_list_changes_nothing(
    store: JobStore, client: redis.Redis, prefix: str, two_dead: tuple[str, str], verb: str
) -> None:
    before = snapshot(client, prefix)
    assert getattr(Morgue(store), verb)([]) in ([], 0)
    assert getattr(Morgue(store), verb)([], queue="other") in ([], 0)
    assert snapshot(client, prefix) == before


@pytest.mark.parametrize("verb", ["retry", "purge"])
def test_everything_takes_all(
    store: JobStore, client: redis.Redis, prefix: str, two_dead: tuple[str, str], verb: str
) -> None:
    morgue = Morgue(store)
    before = snapshot(client, prefix)
    for call in (
        lambda: getattr(morgue, verb)(),
        lambda: getattr(morgue, verb)(queue="other"),
        lambda: getattr(morgue, verb)(task=None, reason=None),
    ):
        with pytest.raises(ValueError, match="all=True"):
            call()
    with pytest.raises(ValueError, match="not both"):
        getattr(morgue, verb)(["x"], all=True)
    with pytest.raises(TypeError):
        getattr(morgue, verb)("abc")
    assert snapshot(client, prefix) == before
    done = getattr(morgue, verb)(queue="other", all=True)
    assert (len(done) if verb == "retry" else done) == 1
    assert [j.queue for j in morgue.ls()] == ["celery"]
    done = getattr(morgue, verb)(all=True)
    assert (len(done) if verb == "retry" else done) == 1
    assert morgue.ls() == []


def test_select_says_what_would_be_acted_on(store: JobStore, two_dead: tuple[str, str]) -> None:
    a, b = two_dead
    morgue = Morgue(store)
    assert [j.id for j in morgue.select([b, a])] == [b, a]
    assert [j.id for j in morgue.select(all=True)] == [a, b]
    assert [j.id for j in morgue.select(task="proj.b")] == [b]
    assert morgue.select([]) == []
    with pytest.raises(UnknownJobError):
        morgue.select([a, "nope"])
    assert len(morgue.ls()) == 2


def test_the_scripts_change_nothing_when_one_id_is_not_dead(
    app: Celery, store: JobStore, client: redis.Redis, prefix: str
) -> None:
    # Checked under the script: a job retried or purged by someone else between the
    # lookup and the call leaves the others of the call where they were.
    a = kill(app, store, "proj.a", when_ms=10_000)
    b = kill(app, store, "proj.b", when_ms=20_000)
    before = snapshot(client, prefix)
    assert store.retry("celery", [a, "gone"], whole=True) == []
    assert store.purge_dead("celery", [b, "gone"], whole=True) == 0
    assert snapshot(client, prefix) == before
    assert store.retry("celery", [a, "gone"]) == [a]
    assert store.purge_dead("celery", [b, "gone"]) == 1


def test_a_job_gone_between_lookup_and_script_stops_its_queue_only(
    store: JobStore, client: redis.Redis, two_dead: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two_dead
    morgue = Morgue(store)
    selected = morgue.select([a, b])
    # Another operator purges b after this call looked it up.
    store.purge_dead("other", [b])
    monkeypatch.setattr(morgue, "select", lambda *args, **kwargs: selected)
    with pytest.raises(UnknownJobError) as raised:
        morgue.retry([a, b])
    assert (raised.value.missing, raised.value.done) == ([b], [a])
    assert "the other 1 job(s) were acted on" in str(raised.value)
    assert store.counts("celery")["pending"] == 1


def bury_many(store: JobStore, n: int, queue: str = "celery") -> list[str]:
    ids = [f"j{i:05d}" for i in range(n)]
    for i, job_id in enumerate(ids):
        store.enqueue(queue, job_id, b"{not json")
        store.bury(queue, job_id, 0, "malformed", "JSONDecodeError", now_ms=10_000 + i)
    store.register(queue)
    return ids


@pytest.mark.parametrize(("verb", "n"), [("purge", 600), ("retry", 150)])
def test_a_job_gone_mid_call_past_one_chunk_is_named_and_the_rest_acted_on(
    store: JobStore, monkeypatch: pytest.MonkeyPatch, verb: str, n: int
) -> None:
    # Purge sends 500 ids a script call, retry 100: the vanished id sits in the first
    # chunk, so a call that stopped at it, or hid it, leaves jobs of later chunks.
    ids = bury_many(store, n)
    morgue = Morgue(store)
    selected = morgue.select(ids)
    gone = ids[3]
    store.purge_dead("celery", [gone])  # a retention trim or another operator
    monkeypatch.setattr(morgue, "select", lambda *args, **kwargs: selected)
    with pytest.raises(UnknownJobError) as raised:
        getattr(morgue, verb)(ids, **({"rate_per_s": None} if verb == "retry" else {}))
    rest = [i for i in ids if i != gone]
    assert raised.value.missing == [gone]
    assert raised.value.done == rest
    assert store.counts("celery")["dead"] == 0
    assert store.counts("celery")["pending"] == (n - 1 if verb == "retry" else 0)


def test_ls_with_a_limit_reads_only_the_rows_it_shows(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 300 dead jobs in two queues, deaths interleaved: the 5 oldest come from both.
    for i in range(150):
        for q, off in (("celery", 0), ("other", 1)):
            job_id = f"{q}-{i:04d}"
            store.enqueue(q, job_id, b"{not json")
            store.bury(q, job_id, 0, "malformed", "JSONDecodeError", now_ms=10_000 + 2 * i + off)
    store.register("celery")
    store.register("other")
    morgue = Morgue(store)
    everything = [j.id for j in morgue.ls()]
    assert len(everything) == 300
    rows: list[int] = []
    ranged: list[int] = []
    real_read, real_zrange = morgue._read, store.client.zrange

    def read(queue: str, ids: list[str]) -> Any:
        rows.append(len(ids))
        return real_read(queue, ids)

    def zrange(*args: Any, **kwargs: Any) -> Any:
        found = real_zrange(*args, **kwargs)
        ranged.append(len(found))
        return found

    monkeypatch.setattr(morgue, "_read", read)
    monkeypatch.setattr(store.client, "zrange", zrange)
    shown = [j.id for j in morgue.ls(limit=5)]
    assert (
        shown
        == everything[:5]
        == [
            "celery-0000",
            "other-0000",
            "celery-0001",
            "other-0001",
            "celery-0002",
        ]
    )
    assert sum(rows) == 5  # today: every one of the 300 rows
    assert sum(ranged) <= 2 * 5  # at most `limit` ids from each queue's morgue
    rows.clear()
    ranged.clear()
    assert [j.id for j in morgue.ls(limit=3, since_ms=10_100)] == everything[100:103]
    assert sum(rows) == 3 and sum(ranged) <= 2 * 3
