"""pytest fixtures for testing your own Celery tasks on ``emq://``.

Installed with celery_emq as a pytest plugin (the ``pytest11`` entry point
``celery_emq``), and inert until a test asks for one of its fixtures: every
fixture is named ``emq_*``, none is autouse, and the only hook adds the ini
option ``emq_redis_url``. ``-p no:celery_emq`` leaves it out altogether.

Fixtures:

``emq_redis_url``
    The Redis the tests use: ``$EMQ_TEST_REDIS_URL``, else the ini option
    ``emq_redis_url``, else ``redis://127.0.0.1:6379/15`` (:data:`DEFAULT_REDIS_URL`).
``emq_prefix``
    A key prefix of the test's own (kombu's ``global_keyprefix``); every key
    under it is deleted after the test (SCAN, never FLUSHDB).
``emq_transport_options``
    Short leases for tests (:data:`TEST_TRANSPORT_OPTIONS`); override it to change them.
``emq_config``
    The Celery settings of ``emq_app``; override it to add your own.
``emq_app``
    A Celery app on ``emq://`` with the Redis result backend, both under the
    test's prefix, current (and default) app while the test runs.
``emq_worker_parameters``
    Keyword arguments of ``emq_worker``'s :func:`celery.contrib.testing.worker.start_worker`.
    Override it with ``pool="prefork"`` to test a task that ends its process
    (``os._exit``, a crash): on the default threads pool it would end pytest.
``emq_worker``
    An in-process worker (threads pool) consuming ``emq_app``'s queues. Tasks
    defined with ``shared_task`` publish through ``emq_app``; a task defined
    with ``@app.task`` on another app publishes through that app's own broker.
``emq``
    An :class:`EmqTestKit`: find a task's job, wait for it to start, lapse its
    lease, run a sweep, read the morgue.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

__all__ = [
    "DEFAULT_REDIS_URL",
    "TEST_TRANSPORT_OPTIONS",
    "EmqTestKit",
    "delete_prefix",
    "redis_url_for",
]

#: The Redis the fixtures use when neither ``$EMQ_TEST_REDIS_URL`` nor the ini
#: option ``emq_redis_url`` names one: database 15 of a local server.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"

#: ``emq_transport_options``: a lease of 2 s renewed every 0.5 s, swept every
#: 0.5 s, so a real lapse takes seconds; :meth:`EmqTestKit.lapse` takes none.
TEST_TRANSPORT_OPTIONS: dict[str, Any] = {
    "lease_ms": 2000,
    "renew_interval_ms": 500,
    "sweep_interval_s": 0.5,
    "settle_delay_ms": 0,
}

_INI = "emq_redis_url"
_ENV = "EMQ_TEST_REDIS_URL"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        _INI,
        f"Redis URL of celery_emq's test fixtures (${_ENV} wins; default {DEFAULT_REDIS_URL})",
        default=None,
    )


def redis_url_for(env: str | None, ini: str | None) -> str:
    """Pick the fixtures' Redis: the environment's, else the ini file's, else the default."""
    return env or ini or DEFAULT_REDIS_URL


def delete_prefix(client: Any, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN in batches); return how many went."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=prefix + "*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch.clear()
    if batch:
        deleted += client.delete(*batch)
    return int(deleted)


class EmqTestKit:
    """What a test needs to drive recovery by hand, on the app's own broker.

    Args:
        app: a Celery app on ``emq://``.

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, app: Any) -> None:
        from celery_emq.ops.morgue import Morgue
        from celery_emq.ops.tasks import open_store
        from celery_emq.transport.jobs import accepted_content
        from celery_emq.transport.sweeper import Sweeper
        from celery_emq.worker.follow_up import CeleryFollowUp

        self.app = app
        self._stack = ExitStack()
        self.store, self.options = self._stack.enter_context(open_store(app))
        self.sweeper = Sweeper(self.store, self.options, CeleryFollowUp(app))
        self.morgue = Morgue(self.store, accepted_content(app))

    def close(self) -> None:
        """Close the broker connection the kit holds."""
        self._stack.close()

    def __enter__(self) -> EmqTestKit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _queues(self, queue: str | None) -> list[str]:
        if queue:
            return [queue]
        default = self.app.conf.task_default_queue or "celery"
        return list(dict.fromkeys([*self.store.queues(), default]))

    def find(self, ident: str, queue: str | None = None) -> tuple[str, str] | None:
        """Return ``(queue, job id)`` of a live job, by Celery task id or job id.

        Live: pending, delayed or active. Looks in ``queue``, or in every
        registered queue and the app's default one.
        """
        for q in self._queues(queue):
            k = self.store.keys(q)
            with self.store.client.pipeline(transaction=False) as pipe:
                pipe.zrange(k.active, 0, -1)
                pipe.zrange(k.pending, 0, -1)
                pipe.zrange(k.delayed, 0, -1)
                ids = [i.decode() for group in pipe.execute() for i in group]
            if ident in ids:
                return q, ident
            for job_id in ids:
                if _task_id(self.store.job(q, job_id)) == ident:
                    return q, job_id
        return None

    def wait_started(self, ident: str, queue: str | None = None, timeout: float = 10.0) -> str:
        """Wait until a worker holds the job of ``ident`` and its task started; return its job id.

        Raises:
            TimeoutError: not started within ``timeout`` seconds.
        """
        from celery_emq.store.scripts import live_token

        deadline = time.monotonic() + timeout
        while True:
            found = self.find(ident, queue)
            if found is not None:
                job = self.store.job(*found)
                live = live_token(job.get("claim"), job.get("deliveries"))
                # `started` holds the claim's delivery count (claim ids of earlier builds).
                if job.get("state") == "active" and job.get("started") in (
                    job.get("deliveries"),
                    live,
                ):
                    return found[1]
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the task of {ident!r} did not start within {timeout} s{_GONE_HINT}"
                )
            time.sleep(0.05)

    def lapse(self, ident: str, queue: str | None = None) -> str:
        """Lapse the lease of an active job, as if the worker holding it were gone.

        The lease deadline moves into the past and the claim is fenced: the
        worker's renewals no longer extend it, so the next sweep counts a stall
        (if the task had started) or requeues the job (if it had not). A task
        that later completes on that worker still settles the job: it leaves
        the morgue, as any job that completed does. Returns the job id.

        Raises:
            LookupError: no active job of ``ident``.
        """
        from celery_emq.store.scripts import live_token, new_nonce

        found = self.find(ident, queue)
        if found is None:
            raise LookupError(f"no live job of {ident!r}{_GONE_HINT}")
        q, job_id = found
        k = self.store.keys(q)
        row = k.job(job_id)
        with self.store.client.pipeline() as pipe:
            # WATCH the row: a claim, settle or sweep in between retries the move.
            for _ in range(100):
                try:
                    pipe.watch(row)
                    state, deliveries, started, claim = (
                        v.decode() if v is not None else None
                        for v in pipe.hmget(row, "state", "deliveries", "started", "claim")
                    )
                    if state != "active":
                        pipe.reset()
                        raise LookupError(f"job {job_id} of {ident!r} is not active ({state!r})")
                    count = int(deliveries or 0) + 1
                    token = f"{count}.{new_nonce()}"
                    fields: dict[str, int | str] = {"deliveries": count, "claim": token}
                    if started is not None and started in (
                        deliveries,
                        live_token(claim, deliveries),
                    ):
                        fields["started"] = count
                    pipe.multi()
                    pipe.hset(row, mapping=fields)
                    pipe.zadd(k.active, {job_id: 1}, xx=True)
                    pipe.execute()
                    return job_id
                except _watch_error():
                    continue
        raise RuntimeError(f"job {job_id} kept changing; could not lapse its lease")

    def sweep(self, *queues: str) -> list[Any]:
        """Run one sweep now (of ``queues``, or every registered queue); return its reports.

        Each :class:`celery_emq.transport.sweeper.SweepReport` lists the job ids
        recovered and dead-lettered; a dead-letter sends
        ``job_dead_lettered`` and stores the task's failure, as a worker's
        sweep does.
        """
        return self.sweeper.run(queues)

    def dead(self, queue: str | None = None, **filters: Any) -> list[Any]:
        """List the morgue's jobs (:meth:`celery_emq.Morgue.ls` filters)."""
        return self.morgue.ls(queue=queue, **filters)


#: Why a started task may have no job left to wait for or lapse.
_GONE_HINT = (
    " (a task without acks_late is acked, and leaves the broker, as it starts;"
    " leases and stalls concern acks_late tasks)"
)


def _task_id(job: dict[str, str]) -> str | None:
    try:
        headers = json.loads(job.get("payload") or "{}").get("headers") or {}
    except ValueError:
        return None
    value = headers.get("id")
    return value if isinstance(value, str) else None


def _watch_error() -> type[Exception]:
    import redis

    return redis.WatchError


@pytest.fixture
def emq_redis_url(request: pytest.FixtureRequest) -> str:
    """The Redis URL the fixtures use (``$EMQ_TEST_REDIS_URL``, ini ``emq_redis_url``, default)."""
    ini = request.config.getini(_INI)
    return redis_url_for(os.environ.get(_ENV), ini if isinstance(ini, str) else None)


@pytest.fixture
def emq_prefix(emq_redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    import redis

    client = redis.Redis.from_url(emq_redis_url)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        client.close()
        pytest.fail(f"celery_emq.testing: no Redis at {emq_redis_url} ({exc}); set ${_ENV}")
    prefix = f"emqtest-{uuid.uuid4().hex[:12]}:"
    try:
        yield prefix
    finally:
        delete_prefix(client, prefix)
        client.close()


@pytest.fixture
def emq_transport_options() -> dict[str, Any]:
    """celery_emq's transport options for the test app (short leases)."""
    return dict(TEST_TRANSPORT_OPTIONS)


@pytest.fixture
def emq_config(
    emq_redis_url: str, emq_prefix: str, emq_transport_options: dict[str, Any]
) -> dict[str, Any]:
    """The Celery settings of ``emq_app``: broker and result backend under the test's prefix."""
    scheme, rest = emq_redis_url.split("://", 1)
    broker = ("emqs" if scheme == "rediss" else "emq") + "://" + rest
    return {
        "broker_url": broker,
        "broker_transport_options": {**emq_transport_options, "global_keyprefix": emq_prefix},
        "result_backend": emq_redis_url,
        "result_backend_transport_options": {"global_keyprefix": emq_prefix},
        "broker_connection_retry_on_startup": False,
    }


@pytest.fixture
def emq_app(emq_config: dict[str, Any]) -> Iterator[Any]:
    """A Celery app on ``emq://``: the current and default app while the test runs."""
    import celery.contrib.testing.tasks  # noqa: F401  (the worker's ping task)
    from celery import Celery
    from celery.contrib.testing.app import setup_default_app

    import celery_emq  # noqa: F401  (the emq:// scheme)

    app = Celery("emq_test", set_as_current=False)
    app.conf.update(emq_config)
    # setup_default_app puts back the current and default apps afterwards.
    with setup_default_app(app, use_trap=False):
        app.set_default()
        app.set_current()
        app.finalize()
        yield app


@pytest.fixture
def emq_worker_parameters() -> dict[str, Any]:
    """Arguments of ``emq_worker``'s ``start_worker`` (pool, concurrency, timeouts...).

    The pool is ``threads``: tasks run in pytest's process. Override this
    fixture with ``{"pool": "prefork", "concurrency": 1}`` for a task that ends
    its process, which then dies in a child the worker replaces.
    """
    return {"pool": "threads", "concurrency": 2, "shutdown_timeout": 15.0}


@pytest.fixture
def emq_worker(emq_app: Any, emq_worker_parameters: dict[str, Any]) -> Iterator[Any]:
    """An in-process worker on ``emq_app`` (Celery's ``start_worker``), stopped after the test.

    Register the tasks before asking for it (``shared_task`` modules imported,
    or tasks defined on ``emq_app`` in a fixture it depends on).
    """
    from celery.contrib.testing.worker import start_worker

    with start_worker(emq_app, **emq_worker_parameters) as worker:
        yield worker


@pytest.fixture
def emq(emq_app: Any) -> Iterator[EmqTestKit]:
    """An :class:`EmqTestKit` on ``emq_app``'s broker."""
    with EmqTestKit(emq_app) as kit:
        yield kit
