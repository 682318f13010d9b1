"""``celery emq migrate``: tasks waiting on kombu's stock ``redis://`` transport move to emq://."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner
from kombu import Connection

from celery_emq.ops.cli import emq as emq_cli
from celery_emq.ops.migrate import BATCH, STAGING, Migration
from tests.faults.servers import RedisServer

N = 1000


@pytest.fixture
def old_prefix(prefix: str) -> str:
    """kombu's global_keyprefix of the stock broker (inside the test's prefix)."""
    return prefix + "old:"


@pytest.fixture
def old_app(redis_url: str, old_prefix: str) -> Iterator[Celery]:
    """A Celery app publishing to the stock Redis transport."""
    a = Celery("old", set_as_current=False)
    a.conf.update(
        broker_url=redis_url,
        broker_transport_options={"global_keyprefix": old_prefix},
        task_acks_late=True,
    )
    yield a
    a.close()


@pytest.fixture
def ledger(emq_app: Celery, client: redis.Redis, prefix: str) -> str:
    """A task on the emq app that counts each run of each ``n`` in a hash."""
    key = prefix + "ledger"

    @emq_app.task(name="ledger.record", acks_late=True)
    def record(n: int) -> None:
        client.hincrby(key, str(n), 1)

    return key


def publish(
    app: Celery, n: int, queue: str = "celery", first: int = 0, **options: Any
) -> list[str]:
    ids = []
    with app.producer_or_acquire() as producer:
        for i in range(first, first + n):
            r = app.send_task("ledger.record", args=(i,), queue=queue, producer=producer, **options)
            ids.append(r.id)
    return ids


def migrate(app: Celery, *args: str) -> dict[str, Any]:
    done = CliRunner().invoke(emq_cli, ["migrate", *args, "--json"], obj=SimpleNamespace(app=app))
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


def old_lists(client: redis.Redis, old_prefix: str, queue: str = "celery") -> int:
    names = [queue] + [f"{queue}\x06\x16{s}" for s in range(1, 10)] + [queue + STAGING]
    return sum(int(client.llen(old_prefix + n)) for n in names)


def moved(report: dict[str, Any], what: str = "moved") -> int:
    return sum(q[what] for q in report["queues"].values())


@pytest.mark.slow
def test_a_thousand_tasks_move_and_each_runs_once(
    old_app: Celery,
    emq_app: Celery,
    ledger: str,
    client: redis.Redis,
    redis_url: str,
    old_prefix: str,
) -> None:
    from celery.contrib.testing.worker import start_worker

    publish(old_app, N - 10)
    publish(old_app, 10, first=N - 10, priority=6)  # kombu's priority sub-queue celery\x06\x166
    assert client.llen(old_prefix + "celery\x06\x166") == 10
    source = ["--from", redis_url, "--from-keyprefix", old_prefix]

    dry = migrate(emq_app, *source, "--dry-run")
    assert dry["dry_run"] is True
    assert dry["queues"]["celery"]["waiting"] == N
    assert moved(dry) == 0
    assert old_lists(client, old_prefix) == N

    report = migrate(emq_app, *source)
    assert report["queues"]["celery"] == {
        "queue": "celery", "waiting": N, "unacked": 0, "moved": N, "moved_unacked": 0,
        "already": 0,
    }  # fmt: skip
    assert old_lists(client, old_prefix) == 0
    assert moved(migrate(emq_app, *source)) == 0

    with start_worker(emq_app, pool="threads", concurrency=4, perform_ping_check=False):
        deadline = time.monotonic() + 40
        while client.hlen(ledger) < N and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = {int(k): int(v) for k, v in client.hgetall(ledger).items()}
    assert runs == dict.fromkeys(range(N), 1)


def test_delivered_but_unacked_messages_move_with_unacked(
    old_app: Celery, emq_app: Celery, client: redis.Redis, redis_url: str, old_prefix: str
) -> None:
    ids = publish(old_app, 8)
    # A worker took five and died before acking them: they wait in kombu's unacked hash.
    with Connection(redis_url, transport_options={"global_keyprefix": old_prefix}) as conn:
        channel = conn.default_channel
        channel.qos.restore_at_shutdown = False
        queue = conn.SimpleQueue("celery", no_ack=False)
        taken = [queue.get(timeout=2) for _ in range(5)]
        queue.close()
    assert client.hlen(old_prefix + "unacked") == 5
    source = ["--from", redis_url, "--from-keyprefix", old_prefix]

    dry = migrate(emq_app, *source, "--unacked", "--dry-run")
    assert dry["queues"]["celery"]["waiting"] == 3
    assert dry["queues"]["celery"]["unacked"] == 5

    without = migrate(emq_app, *source)
    assert (moved(without), moved(without, "moved_unacked")) == (3, 0)
    assert client.hlen(old_prefix + "unacked") == 5  # left alone without --unacked

    report = migrate(emq_app, *source, "--unacked")
    assert moved(report, "moved_unacked") == 5
    assert client.hlen(old_prefix + "unacked") == 0
    assert client.zcard(old_prefix + "unacked_index") == 0

    with Connection(
        emq_app.conf.broker_url, transport_options=emq_app.conf.broker_transport_options
    ) as conn:
        store = conn.default_channel.store
        assert store.counts("celery")["pending"] == 8
        # The job id is the stock message's delivery tag; a redelivery is marked so.
        tag = taken[0].delivery_tag
        job = store.job("celery", tag)
        assert json.loads(job["payload"])["headers"]["id"] in ids
        assert json.loads(job["payload"])["headers"]["redelivered"] is True


def test_a_message_moved_twice_is_one_job(
    old_app: Celery, emq_app: Celery, client: redis.Redis, redis_url: str, old_prefix: str
) -> None:
    publish(old_app, 3)
    raw = client.lindex(old_prefix + "celery", -1)
    assert moved(migrate(emq_app, "--from", redis_url, "--from-keyprefix", old_prefix)) == 3
    # A run stopped after its enqueue, before it removed the message from the source:
    client.lpush(old_prefix + "celery" + STAGING, raw)
    again = migrate(emq_app, "--from", redis_url, "--from-keyprefix", old_prefix)
    assert (moved(again), moved(again, "already")) == (0, 1)
    assert client.llen(old_prefix + "celery" + STAGING) == 0


def test_queues_are_found_from_the_bindings_or_named(
    old_app: Celery, emq_app: Celery, client: redis.Redis, redis_url: str, old_prefix: str
) -> None:
    publish(old_app, 2, queue="emails")
    publish(old_app, 1, queue="reports")
    source = ["--from", redis_url, "--from-keyprefix", old_prefix]
    dry = migrate(emq_app, *source, "--dry-run")
    assert {q: c["waiting"] for q, c in dry["queues"].items() if c["waiting"]} == {
        "emails": 2, "reports": 1,
    }  # fmt: skip
    only = migrate(emq_app, *source, "--queue", "reports")
    assert list(only["queues"]) == ["reports"] and moved(only) == 1
    assert client.llen(old_prefix + "emails") == 2


def test_the_stored_job_is_what_a_publish_on_emq_stores(
    old_app: Celery, emq_app: Celery, client: redis.Redis, redis_url: str, old_prefix: str
) -> None:
    publish(old_app, 1, priority=3)
    raw = json.loads(client.lindex(old_prefix + "celery\x06\x163", 0))
    migrate(emq_app, "--from", redis_url, "--from-keyprefix", old_prefix)
    with Connection(
        emq_app.conf.broker_url, transport_options=emq_app.conf.broker_transport_options
    ) as conn:
        channel = conn.default_channel
        migrated = channel.store.job("celery", raw["properties"]["delivery_tag"])
        twin = json.loads(json.dumps(raw))
        twin["properties"]["delivery_tag"] = "twin"
        channel._put("twin-q", twin)
        published = channel.store.job("twin-q", "twin")
    for row in (migrated, published):
        row.pop("queue"), row.pop("enqueued_ms")
    assert migrated == published
    assert migrated["priority"] == "3"


def test_a_second_migration_at_once_is_refused(
    emq_app: Celery, client: redis.Redis, redis_url: str, old_prefix: str
) -> None:
    client.set(old_prefix + "_emq.migrate.lock", "someone", ex=60)
    done = CliRunner().invoke(
        emq_cli,
        ["migrate", "--from", redis_url, "--from-keyprefix", old_prefix],
        obj=SimpleNamespace(app=emq_app),
    )
    assert done.exit_code != 0
    assert "another `emq migrate`" in done.output


def test_the_source_must_be_a_stock_redis_url(emq_app: Celery) -> None:
    done = CliRunner().invoke(
        emq_cli, ["migrate", "--from", "emq://127.0.0.1/6"], obj=SimpleNamespace(app=emq_app)
    )
    assert done.exit_code != 0
    assert "redis://" in done.output


def test_migration_reads_kombu_bindings_to_route_unacked(client: redis.Redis, prefix: str) -> None:
    client.sadd(prefix + "_kombu.binding.tasks", "a.*\x06\x16a.*\x06\x16qa", "b\x06\x16b\x06\x16qb")
    m = Migration(client, SimpleNamespace(store=None), prefix, {"tasks": "topic"})  # type: ignore[arg-type]
    assert m.route("tasks", "a.x") == ["qa"]
    assert m.route("", "direct-q") == ["direct-q"]
    assert m.bound_queues() == ["qa", "qb"]


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own: its scripts can be flushed without touching anyone's."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def forget_scripts_before(
    monkeypatch: pytest.MonkeyPatch, server: redis.Redis, runs: set[int]
) -> Callable[[], None]:
    """The server forgets its scripts just before the ``runs``-th pipelines that run one.

    As after a restart or a failover to a replica that never loaded them: between
    the client's load (redis-py's, or the caller's) and the EVALSHAs. Returns a
    function that stops it.
    """
    seen = [0]
    on = [True]
    for name in ("_execute_transaction", "_execute_pipeline"):
        real = getattr(redis.client.Pipeline, name)

        def run(self: Any, connection: Any, commands: Any, *rest: Any, _real: Any = real) -> Any:
            if on[0] and any(args[0] == "EVALSHA" for args, _ in commands):
                seen[0] += 1
                if seen[0] in runs:
                    server.script_flush()
            return _real(self, connection, commands, *rest)

        monkeypatch.setattr(redis.client.Pipeline, name, run)

    def stop() -> None:
        on[0] = False

    return stop


def test_scripts_forgotten_in_a_batch_lose_none_of_its_messages(
    own_server: RedisServer,
    old_prefix: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = own_server.url
    server = own_server.client()
    old = Celery("old", set_as_current=False)
    old.conf.update(broker_url=url, broker_transport_options={"global_keyprefix": old_prefix})
    new = Celery("new", set_as_current=False)
    new.conf.update(
        broker_url=url.replace("redis://", "emq://", 1),
        broker_transport_options={"global_keyprefix": prefix},
    )
    total = BATCH + 50
    publish(old, total)
    source = ["--from", url, "--from-keyprefix", old_prefix]

    stop = forget_scripts_before(monkeypatch, server, runs={2})
    failed = CliRunner().invoke(
        emq_cli, ["migrate", *source, "--json"], obj=SimpleNamespace(app=new)
    )
    assert failed.exit_code != 0
    stop()
    with Connection(new.conf.broker_url, transport_options=new.conf.broker_transport_options) as c:
        store = c.default_channel.store
        k = store.keys("celery")
        # A tag taken in is a job; the rest still wait on the source.
        taken = [t.decode() for t in server.zrange(k.migrated, 0, -1)]
        assert all(server.exists(k.job(t)) for t in taken)
        assert len(taken) + old_lists(server, old_prefix) == total

        report = migrate(new, *source)
        assert moved(report) == total - len(taken)
        assert old_lists(server, old_prefix) == 0
        assert store.counts("celery")["pending"] == total
    server.close()
    old.close()
    new.close()


@pytest.mark.slow
def test_a_cluster_target_whose_nodes_never_loaded_the_scripts(
    old_app: Celery, redis_url: str, old_prefix: str, prefix: str, client: redis.Redis
) -> None:
    from redis.cluster import ClusterNode, RedisCluster

    from tests.topology.cluster_servers import Cluster

    cluster = Cluster(masters=3, replicas=0)
    try:
        cluster.start()
        nodes = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
        new = Celery("new", set_as_current=False)
        new.conf.update(
            broker_url=cluster.url, broker_transport_options={"global_keyprefix": prefix}
        )
        publish(old_app, BATCH + 20)
        publish(old_app, 30, queue="emails")
        source = ["--from", redis_url, "--from-keyprefix", old_prefix]
        report = migrate(new, *source, "--queue", "celery", "--queue", "emails")
        assert {q: c["moved"] for q, c in report["queues"].items()} == {
            "celery": BATCH + 20, "emails": 30,
        }  # fmt: skip
        assert old_lists(client, old_prefix) == old_lists(client, old_prefix, "emails") == 0
        assert moved(migrate(new, *source, "--queue", "celery", "--queue", "emails")) == 0
        with Connection(
            new.conf.broker_url, transport_options=new.conf.broker_transport_options
        ) as c:
            store = c.default_channel.store
            assert isinstance(store.client, RedisCluster)
            assert store.counts("celery")["pending"] == BATCH + 20
            assert store.counts("emails")["pending"] == 30
        nodes.close()
        new.close()
    finally:
        cluster.stop()
