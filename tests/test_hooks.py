"""Celery's internals behind one door: each hook checked on the running Celery, at worker start."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import billiard.pool
import celery
import celery.worker.state
import pytest
from celery.concurrency import thread
from celery.concurrency.asynpool import AsynPool
from celery.concurrency.base import BasePool
from celery.worker.consumer.consumer import Consumer
from celery.worker.control import Panel
from celery.worker.request import Request

from celery_emq.errors import CeleryHookMissingError, EmqError
from celery_emq.transport import process
from celery_emq.worker import hooks, state
from celery_emq.worker.hooks import HOOKS, Hook

ROOT = Path(__file__).resolve().parents[1]
CELERY_RELEASE = tuple(int(p) for p in celery.__version__.split(".")[:2])


def _replace_init(owner: type, init: Callable[..., None]) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda mp: mp.setattr(owner, "__init__", init)


def _no_accepted(self: Any, *args: Any, **kwargs: Any) -> None:
    self._write_to = None


def _no_future(self: Any, future: Any) -> None:
    self.future = future


def _execute_without_accept_callback(self: Any, pool: Any, **kwargs: Any) -> Any:
    return pool.apply_async(print, args=(self,), callback=None)


#: How each hook is taken away or misshapen, as a Celery release might.
BREAK: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "Consumer.on_decode_error": lambda mp: mp.delattr(Consumer, "on_decode_error"),
    "Consumer.on_unknown_message": lambda mp: mp.setattr(
        Consumer, "on_unknown_message", lambda self, message: None
    ),
    "Consumer.on_unknown_task": lambda mp: mp.delattr(Consumer, "on_unknown_task"),
    "Consumer.on_invalid_task": lambda mp: mp.setattr(Consumer, "on_invalid_task", "renamed"),
    "Consumer.start": lambda mp: mp.delattr(Consumer, "start"),
    "Consumer.shutdown": lambda mp: mp.delattr(Consumer, "shutdown"),
    "Request.on_failure": lambda mp: mp.setattr(
        Request, "on_failure", lambda self, einfo, send_failed_event=True: None
    ),
    "Request._already_cancelled": lambda mp: mp.delattr(Request, "_already_cancelled"),
    "Request._already_revoked": lambda mp: mp.delattr(Request, "_already_revoked"),
    "Request._success_was_stored": lambda mp: mp.delattr(
        Request, "_success_was_stored", raising=False
    ),
    "Request.on_accepted": lambda mp: mp.delattr(Request, "on_accepted"),
    "BasePool.apply_async": lambda mp: mp.setattr(
        Request, "execute_using_pool", _execute_without_accept_callback
    ),
    "billiard ApplyResult._accepted/_write_to": _replace_init(
        billiard.pool.ApplyResult, _no_accepted
    ),
    "AsynPool.flush": lambda mp: mp.delattr(AsynPool, "flush"),
    "AsynPool.on_partial_read": lambda mp: mp.delattr(AsynPool, "on_partial_read"),
    "threads ApplyResult.f": _replace_init(thread.ApplyResult, _no_future),
    "celery.worker.state.active_requests": lambda mp: mp.delattr(
        celery.worker.state, "active_requests"
    ),
    "celery.worker.state.reserved_requests": lambda mp: mp.delattr(
        celery.worker.state, "reserved_requests"
    ),
    'Panel.data["revoke"]': lambda mp: mp.delitem(Panel.data, "revoke"),
    "celery.worker.state.revoked": lambda mp: mp.setattr(
        celery.worker.state, "revoked", frozenset()
    ),
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(hooks, "_warned", set())


def test_every_hook_holds_on_the_installed_celery() -> None:
    assert hooks.find_problems() == []
    hooks.verify()


def test_every_hook_has_a_way_to_break_it_here() -> None:
    names = [hook.name for hook in HOOKS]
    assert len(set(names)) == len(names)
    assert set(BREAK) == set(names)


def test_the_check_reads_through_installed_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Once installed, the probes stand where Celery's methods were; checking
    # again (another worker in this process) reads the shape of what they wrap.
    for owner, name in [
        (Consumer, "on_decode_error"),
        (Request, "on_failure"),
        (Request, "on_accepted"),
        (BasePool, "apply_async"),
        (AsynPool, "flush"),
    ]:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setitem(Panel.data, "revoke", Panel.data["revoke"])
    hooks.wrap_consumer("on_decode_error", lambda self, message, exc: None)
    hooks.wrap_on_failure(lambda request, exc_info, celerys_own: celerys_own())
    hooks.wrap_on_accepted(lambda request: None)
    hooks.wrap_apply_async(lambda pool, request, celerys_own: celerys_own())
    hooks.wrap_revoke(lambda app, task_ids: None)
    hooks.keep_started_jobs_on_flush()
    hooks.read_acks_before_put_back()
    for probe in (
        Consumer.on_decode_error,
        Request.on_failure,
        AsynPool.flush,
        AsynPool.on_partial_read,
    ):
        assert getattr(probe, "_emq_probe", False)
    assert getattr(Panel.data["revoke"], "_emq_probe", False)
    assert hooks.find_problems() == []


@pytest.mark.parametrize("hook", HOOKS, ids=[hook.name for hook in HOOKS])
def test_a_missing_hook_is_named_with_its_guarantee(
    hook: Hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    BREAK[hook.name](monkeypatch)
    if hook.since is not None and CELERY_RELEASE < hook.since:
        # Absent before the release that added it: expected, nothing to say.
        assert hooks.find_problems() == []
        return
    [(found, problem)] = hooks.find_problems()
    assert found is hook and problem
    if hook.required:
        with pytest.raises(CeleryHookMissingError) as raised:
            hooks.verify()
        message = str(raised.value)
        assert f"{hook.name} ({problem})" in message
        assert hook.guarantee in message
        assert f"celery {celery.__version__}" in message and "kombu " in message
        assert raised.value.missing == ((hook.name, problem, hook.guarantee),)
        assert isinstance(raised.value, EmqError)
    else:
        with caplog.at_level(logging.WARNING, logger=hooks.__name__):
            hooks.verify()
            hooks.verify()
        [record] = [r for r in caplog.records if r.name == hooks.__name__]
        assert hook.name in record.getMessage()
        assert hook.guarantee in record.getMessage()
        assert f"celery {celery.__version__}" in record.getMessage()


def test_every_missing_required_hook_is_named_in_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    BREAK["Request.on_failure"](monkeypatch)
    BREAK["AsynPool.flush"](monkeypatch)
    with pytest.raises(CeleryHookMissingError) as raised:
        hooks.verify()
    assert [name for name, _, _ in raised.value.missing] == ["Request.on_failure", "AsynPool.flush"]
    assert "takes (self, einfo, send_failed_event), not (self, exc_info, ...)" in str(raised.value)


def test_a_worker_being_built_without_a_hook_is_refused_by_a_bootstep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Celery logs and swallows what a worker_init receiver raises: the refusal
    # is a worker bootstep that raises as the worker builds its steps.
    BREAK["Request.on_failure"](monkeypatch)
    app = celery.Celery("refused", set_as_current=False)
    state._on_worker_init(sender=SimpleNamespace(app=app))
    [step] = [s for s in app.steps["worker"] if s.name == "celery_emq.RefuseStart"]
    with pytest.raises(
        CeleryHookMissingError, match=r"lacks Request\.on_failure \(takes \(self, einfo"
    ):
        step(None)


def test_a_transport_starting_in_a_worker_without_a_hook_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worker's consumer is loaded in this process, as in a worker whose
    # transport starts after the worker did.
    BREAK["AsynPool.flush"](monkeypatch)
    assert state.in_worker()
    with pytest.raises(CeleryHookMissingError, match=r"lacks AsynPool\.flush \(absent\)"):
        process.transport_started()


#: A producer, then Flower (as ``celery flower`` loads it, where installed),
#: each starting a transport, then a worker's consumer module loaded: only the
#: last checks.
CHECKS_ONLY_IN_A_WORKER = """
import importlib.util, sys
from types import SimpleNamespace
from celery import Celery
import celery_emq
from celery_emq.worker import hooks

checks = []
hooks.verify = lambda *a, **k: checks.append(1)
app = Celery("producer", broker=sys.argv[1], set_as_current=False)
app.conf.broker_transport_options = {"global_keyprefix": sys.argv[2]}
with app.connection_for_write() as conn:
    conn.default_channel
print("producer", len(checks))

if importlib.util.find_spec("flower") is not None:
    import celery.bin.celery, flower.command
    from flower.app import Flower
    from flower.options import default_options
    Flower(capp=app, options=SimpleNamespace(**{**default_options.as_dict(), "url_prefix": ""}))
    with app.connection_for_read() as conn:
        conn.default_channel
    print("flower", len(checks))

import celery.worker.consumer
with app.connection_for_read() as conn:
    conn.default_channel
print("worker", len(checks))
"""


def test_the_check_runs_in_a_worker_never_in_a_producer_or_flower(
    broker_url: str, prefix: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECKS_ONLY_IN_A_WORKER, broker_url, prefix],
        cwd=ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    checks = dict(zip(words[::2], map(int, words[1::2]), strict=True))
    flower = {"flower": 0} if importlib.util.find_spec("flower") else {}
    # A transport and its channel each start: a worker checks at both.
    assert checks == {"producer": 0, **flower, "worker": 2}


def test_the_docs_list_every_hook_with_what_it_serves() -> None:
    text = (ROOT / "docs" / "hooks.md").read_text()
    for hook in HOOKS:
        assert f"| `{hook.name}` | {hook.use} | {hook.guarantee} | " in text


@pytest.mark.parametrize(("acked", "put_back"), [(True, 0), (False, 1)])
def test_a_dead_childs_pending_ack_is_read_before_its_job_is_put_back(
    acked: bool, put_back: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second child died before the pool read the ACK it sent for its job:
    # the pool finds the job written to a dead child and "not accepted". With
    # the ACK read from the child's pipe first, the job is not put back (run a
    # second time on the same delivery); with no ACK there, it is, as before.
    monkeypatch.setattr(AsynPool, "on_partial_read", AsynPool.on_partial_read)
    hooks.read_acks_before_put_back()
    job = SimpleNamespace(_accepted=False, _writer=lambda: None)
    proc = SimpleNamespace(dead=True, outq=SimpleNamespace(_reader=SimpleNamespace(closed=False)))
    calls: dict[str, int] = {"flush": 0, "put_back": 0}

    def flush(p: Any) -> None:
        assert p is proc
        calls["flush"] += 1
        if acked:
            job._accepted = True  # what reading the ACK does (ApplyResult._ack)

    def back(j: Any) -> None:
        calls["put_back"] += j is job

    pool = SimpleNamespace(process_flush_queues=flush, _put_back=back, _active_writers=set())
    AsynPool.on_partial_read(pool, job, proc)
    assert calls == {"flush": 1, "put_back": put_back}
    # An accepted job's child is not read again; a closed pipe is not read.
    AsynPool.on_partial_read(pool, SimpleNamespace(_accepted=True, _writer=lambda: None), proc)
    proc.outq._reader.closed = True
    AsynPool.on_partial_read(pool, SimpleNamespace(_accepted=False, _writer=lambda: None), proc)
    assert calls == {"flush": 1, "put_back": put_back}
