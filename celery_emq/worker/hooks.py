"""Celery's and billiard's internals: touched here, and nowhere else, each checked at worker start.

No public signal tells why Celery settles a delivery, which jobs its pool has
handed to a process, or lets a revoke reach the broker's delayed sets. So a
few of Celery's methods are wrapped and a few of its attributes read. Each
such hook is a row of :data:`HOOKS`, with what it wraps or reads and the
guarantee it serves; :func:`verify` checks every row on the running Celery as
a worker starts. A hook the worker cannot do without stops the worker with
:class:`~celery_emq.errors.CeleryHookMissingError`; one whose loss only
weakens a guarantee is warned about once. docs/hooks.md shows the same table.

This module knows where Celery keeps things; the modules beside it decide
what to do (they pass in what runs when a hook fires). Celery is imported
only when a hook is installed or checked, that is inside a worker.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from celery_emq.errors import CeleryHookMissingError
from celery_emq.worker import shapes
from celery_emq.worker.shapes import all_of, attribute, mentions, method

__all__ = [
    "HOOKS",
    "Hook",
    "active_delivery_tags",
    "already_cancelled",
    "already_revoked",
    "find_problems",
    "is_prefork",
    "is_solo",
    "job_written",
    "keep_started_jobs_on_flush",
    "read_acks_before_put_back",
    "remember_revoked",
    "reserved_count",
    "success_was_stored",
    "task_ready",
    "threads_future",
    "verify",
    "versions",
    "wrap_apply_async",
    "wrap_consumer",
    "wrap_on_accepted",
    "wrap_on_failure",
    "wrap_revoke",
]

logger = logging.getLogger(__name__)

_CONSUMER = "celery.worker.consumer.consumer:Consumer"
_REQUEST = "celery.worker.request:Request"
_STATE = "celery.worker.state"
_BASE_POOL = "celery.concurrency.base:BasePool"
_ASYNPOOL = "celery.concurrency.asynpool:AsynPool"
_BILLIARD_RESULT = "billiard.pool:ApplyResult"
_THREADS_RESULT = "celery.concurrency.thread:ApplyResult"
_PANEL = "celery.worker.control:Panel"


@dataclass(frozen=True)
class Hook:
    """One of Celery's internals celery_emq relies on."""

    #: Where it lives, as ``Owner.attribute``.
    name: str
    #: What celery_emq does with it.
    use: str
    #: What holds only while it works.
    guarantee: str
    #: Returns what is wrong with it on the running Celery, or ``""``.
    check: shapes.Check
    #: Whether the worker refuses to start without it (else: a warning, once).
    required: bool = True
    #: The Celery release that added it; on an older one its absence is expected.
    since: tuple[int, int] | None = None


def _consumer(name: str, *params: str, reason: str, required: bool = False) -> Hook:
    return Hook(
        f"Consumer.{name}",
        "wrapped: marks the delivery before Celery settles it",
        f"a message {reason} is dead-lettered with that reason"
        + ("" if required else " (without: dead-lettered as 'rejected')"),
        method(_CONSUMER, name, "self", *params),
        required=required,
    )


#: Every Celery and billiard internal used, in the order they are installed.
HOOKS: tuple[Hook, ...] = (
    _consumer("on_decode_error", "message", "exc", reason="Celery cannot decode", required=True),
    _consumer("on_unknown_message", "body", "message", reason="that is not a task"),
    _consumer("on_unknown_task", "body", "message", "exc", reason="of an unregistered task"),
    _consumer("on_invalid_task", "body", "message", "exc", reason="with an invalid task"),
    Hook(
        "Consumer.start",
        "wrapped: notes the worker's node name (Consumer.hostname)",
        "a dead-lettered task's task-failed event names the worker that held it "
        "(without: the host name)",
        method(_CONSUMER, "start", "self"),
        required=False,
    ),
    Hook(
        "Consumer.shutdown",
        "wrapped: forgets the node name",
        "a worker run inside another process leaves no node name behind",
        method(_CONSUMER, "shutdown", "self"),
        required=False,
    ),
    Hook(
        "Request.on_failure",
        "replaced around Celery's: a lost pool process requeues the delivery, marked",
        "a task whose pool process died is charged a stall (worker_lost) against its budget",
        all_of(method(_REQUEST, "on_failure", "self", "exc_info"), method(_STATE, "task_ready")),
    ),
    Hook(
        "Request._already_cancelled",
        "read: Celery cancelled the task as the broker connection dropped",
        "a task cancelled on connection loss gives its claim back at once, uncounted",
        attribute(_REQUEST, "_already_cancelled"),
    ),
    Hook(
        "Request._already_revoked",
        "read: the task was revoked",
        "a revoked task's exit is not charged as a lost process",
        attribute(_REQUEST, "_already_revoked"),
    ),
    Hook(
        "Request._success_was_stored",
        "called: the task's success was stored before its process died",
        "a task that finished before its process died is acked, not run again",
        method(_REQUEST, "_success_was_stored", "self"),
        required=False,
        since=(5, 7),
    ),
    Hook(
        "Request.on_accepted",
        "wrapped: a prefork child accepted the job",
        "a prefork task's start is recorded, so its worker's death is charged a stall",
        method(_REQUEST, "on_accepted", "self"),
    ),
    Hook(
        "BasePool.apply_async",
        "wrapped: notes each delivery handed to the pool (its accept_callback's request)",
        "a claim whose task runs, or surely will, is kept held when the connection drops",
        all_of(
            method(_BASE_POOL, "apply_async", "self", "target"),
            mentions(f"{_REQUEST}.execute_using_pool", "accept_callback"),
        ),
    ),
    Hook(
        "billiard ApplyResult._accepted/_write_to",
        "read: a prefork job reached a child",
        "a claim whose job was written to a prefork child is kept held when the connection drops",
        all_of(mentions(_BILLIARD_RESULT, "_accepted"), attribute(_BILLIARD_RESULT, "_write_to")),
    ),
    Hook(
        "AsynPool.flush",
        "replaced around Celery's: keeps the pool's _cache entries a child has",
        "a job written to a prefork child before a reconnect is acked when it finishes",
        all_of(
            method(_ASYNPOOL, "flush", "self"),
            mentions(f"{_ASYNPOOL}.flush", "_cache"),
            mentions("billiard.pool:Pool", "_cache"),
        ),
    ),
    Hook(
        "AsynPool.on_partial_read",
        "wrapped: reads a dead child's pending messages before a job it was written is put back",
        "a prefork job whose child accepted it and died runs no second time on that delivery "
        "(charged a stall instead)",
        all_of(
            method(_ASYNPOOL, "on_partial_read", "self", "job", "proc"),
            method(_ASYNPOOL, "process_flush_queues", "self", "proc"),
            mentions(f"{_ASYNPOOL}.on_partial_read", "_accepted"),
        ),
    ),
    Hook(
        "threads ApplyResult.f",
        "read: the future of a task handed to the threads pool",
        "a threads task cancelled by a warm shutdown gives its claim back at once "
        "(without: after its lease)",
        mentions(_THREADS_RESULT, "f"),
        required=False,
    ),
    Hook(
        "celery.worker.state.active_requests",
        "read: the deliveries whose tasks run",
        "a claim whose task runs is kept held when the connection drops",
        attribute(_STATE, "active_requests", "__iter__"),
    ),
    Hook(
        "celery.worker.state.reserved_requests",
        "read: how many tasks wait for the pool",
        "a busy prefork or solo worker tops up its prefetch in batches (without: one by one)",
        attribute(_STATE, "reserved_requests", "__len__"),
        required=False,
    ),
    Hook(
        'Panel.data["revoke"]',
        "wrapped: a revoke promotes the task's delayed jobs, marked revoked",
        "a revoked task delayed in the broker is discarded, however long it was delayed",
        method(f"{_PANEL}.data", "revoke", "state", "task_id"),
        required=False,
    ),
    Hook(
        "celery.worker.state.revoked",
        "added to: the task ids promoted as revoked",
        "a worker that never heard a revoke still discards the revoked task",
        attribute(_STATE, "revoked", "add"),
        required=False,
    ),
)


def versions() -> str:
    """The running Celery, kombu and billiard versions, for messages."""
    found = []
    for name in ("celery", "kombu", "billiard"):
        module = sys.modules.get(name) or importlib.import_module(name)
        found.append(f"{name} {getattr(module, '__version__', '?')}")
    return ", ".join(found)


def _celery_release() -> tuple[int, int]:
    major, minor = (int(part) for part in shapes.find("celery").__version__.split(".")[:2])
    return major, minor


def find_problems(hooks: tuple[Hook, ...] = HOOKS) -> list[tuple[Hook, str]]:
    """Return each hook that is missing or misshapen here, with what is wrong."""
    release = _celery_release()
    problems = []
    for hook in hooks:
        if hook.since is not None and release < hook.since:
            continue
        try:
            problem = hook.check()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            problems.append((hook, problem))
    return problems


_warned: set[str] = set()


def verify(hooks: tuple[Hook, ...] = HOOKS) -> None:
    """Check every hook on the running Celery.

    Raises:
        CeleryHookMissingError: a required hook is missing or misshapen. The
            others that are wrong are logged as a warning, once per process.
    """
    problems = find_problems(hooks)
    missing = [(hook.name, problem, hook.guarantee) for hook, problem in problems if hook.required]
    if missing:
        raise CeleryHookMissingError(missing, versions())
    for hook, problem in problems:
        if hook.name not in _warned:
            _warned.add(hook.name)
            logger.warning(
                "celery_emq: %s lacks %s (%s): this guarantee no longer holds: %s",
                versions(),
                hook.name,
                problem,
                hook.guarantee,
            )


# -- Installing the wrappers (once per process each) -------------------------------------------


def _ours(function: Any) -> bool:
    return bool(getattr(function, "_emq_probe", False))


def _install(owner: Any, name: str, wrapper: Callable[..., Any], original: Any) -> None:
    functools.update_wrapper(wrapper, original)
    wrapper._emq_probe = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _before(path: str, name: str, before: Callable[..., None], with_args: bool = True) -> None:
    owner = shapes.find(path)
    original = getattr(owner, name)
    if _ours(original):
        return

    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        if with_args:
            before(self, *args)
        else:
            before(self)
        return original(self, *args, **kwargs)

    _install(owner, name, probe, original)


def wrap_consumer(name: str, before: Callable[..., None]) -> None:
    """Call ``before(consumer, *args)`` ahead of ``Consumer.<name>``."""
    _before(_CONSUMER, name, before)


def wrap_on_accepted(before: Callable[[Any], None]) -> None:
    """Call ``before(request)`` ahead of ``Request.on_accepted`` (a prefork child took the job)."""
    _before(_REQUEST, "on_accepted", before, with_args=False)


def wrap_on_failure(handler: Callable[[Any, Any, Callable[[], Any]], Any]) -> None:
    """Route ``Request.on_failure`` through ``handler(request, exc_info, celerys_own)``."""
    request = shapes.find(_REQUEST)
    original = request.on_failure
    if _ours(original):
        return

    def on_failure(self: Any, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        return handler(self, exc_info, lambda: original(self, exc_info, *args, **kwargs))

    _install(request, "on_failure", on_failure, original)


def wrap_apply_async(submit: Callable[[Any, Any, Callable[[], Any]], Any]) -> None:
    """Route ``BasePool.apply_async`` through ``submit(pool, request, celerys_own)``.

    The request is the one whose ``on_accepted`` Celery passes as the
    ``accept_callback`` (None when the pool is handed something else).
    """
    base_pool = shapes.find(_BASE_POOL)
    original = base_pool.apply_async
    if _ours(original):
        return

    def apply_async(self: Any, target: Any, *args: Any, **options: Any) -> Any:
        request = getattr(options.get("accept_callback"), "__self__", None)
        return submit(self, request, lambda: original(self, target, *args, **options))

    _install(base_pool, "apply_async", apply_async, original)


def wrap_revoke(after: Callable[[Any, list[str]], None]) -> None:
    """Call ``after(app, task_ids)`` once Celery's ``revoke`` remote command ran."""
    panel = shapes.find(_PANEL)
    original = panel.data.get("revoke")
    if original is None or _ours(original):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        after(state.app, [str(i) for i in ids])
        return reply

    functools.update_wrapper(revoke, original)
    revoke._emq_probe = True  # type: ignore[attr-defined]
    panel.data["revoke"] = revoke


def keep_started_jobs_on_flush() -> None:
    """Keep the prefork pool's jobs a child has, or will run, when the connection drops.

    On a broker reconnect Celery empties the prefork pool's job table: before
    5.6.3 of every job, since of every job no child acknowledged starting. But
    a child runs a job written to its pipe (``_write_to``) all the same, unseen
    by the worker, which never acks it: its claim, kept for the started task,
    would stay leased for ever. Jobs a child accepted or was written are kept;
    only those still in the outgoing buffer are dropped.
    """
    asynpool = shapes.find(_ASYNPOOL)
    original = asynpool.flush
    if _ours(original):
        return

    def flush(self: Any) -> Any:
        kept = {key: job for key, job in self._cache.items() if job_written(job)}
        try:
            return original(self)
        finally:
            for key, job in kept.items():
                self._cache.setdefault(key, job)

    _install(asynpool, "flush", flush, original)


def read_acks_before_put_back() -> None:
    """Have the prefork pool read a dead child's messages before it puts a job back.

    A child acknowledges a job (billiard's ``ACK``, Celery's ``on_accepted``)
    before it runs the task. When one child dies, the pool reaps it and then
    looks at every job: a job written to a second child that has died too but
    is not reaped yet, whose ``ACK`` is still unread in that child's pipe, is
    taken as never accepted (``on_partial_read``) and put back for another
    child, while the pipe holding the ``ACK`` is closed. The task then runs a
    second time on the same delivery, and that first run is never charged (two
    poison tasks on two children dying together). Reading the child's pending
    messages first (Celery's ``process_flush_queues``, as when it reaps a child)
    lets the ``ACK`` count: the job is not put back, and the worker reports it
    lost (``WorkerLostError``) once it reaps that child.
    """
    asynpool = shapes.find(_ASYNPOOL)
    original = asynpool.on_partial_read
    if _ours(original):
        return

    def on_partial_read(self: Any, job: Any, proc: Any) -> Any:
        if not job._accepted:
            reader = getattr(getattr(proc, "outq", None), "_reader", None)
            if reader is not None and not reader.closed:
                self.process_flush_queues(proc)
        return original(self, job, proc)

    _install(asynpool, "on_partial_read", on_partial_read, original)


# -- Reading what Celery keeps -----------------------------------------------------------------


def already_cancelled(request: Any) -> bool:
    """Whether Celery cancelled the request's task as the broker connection dropped."""
    return bool(getattr(request, "_already_cancelled", False))


def already_revoked(request: Any) -> bool:
    """Whether the request's task was revoked."""
    return bool(getattr(request, "_already_revoked", False))


def success_was_stored(request: Any) -> bool:
    """Whether the request's task stored its success (known on Celery 5.7 and later)."""
    stored = getattr(request, "_success_was_stored", None)
    return stored is not None and bool(stored())


def task_ready(request: Any) -> None:
    """Tell Celery's worker state the request is done (what it does before a requeue)."""
    shapes.find(_STATE).task_ready(request)


def job_written(job: Any) -> bool:
    """Whether a prefork job reached a child (written to its pipe, or accepted)."""
    return bool(getattr(job, "_accepted", False)) or getattr(job, "_write_to", None) is not None


def threads_future(job: Any) -> Future[Any] | None:
    """The future of a job handed to the threads pool, else None."""
    future = getattr(job, "f", None)
    return future if isinstance(future, Future) else None


def active_delivery_tags() -> set[str]:
    """The delivery tags of the requests Celery runs; empty outside a worker.

    Read only when ``celery.worker.state`` is already loaded, so a plain kombu
    client pays nothing.
    """
    state = sys.modules.get(_STATE)
    tags = set()
    for request in list(getattr(state, "active_requests", ())):
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if isinstance(tag, str):
            tags.add(tag)
    return tags


def reserved_count() -> int | None:
    """How many received tasks wait to run (ETA tasks left out); None outside a worker."""
    state = sys.modules.get(_STATE)
    reserved = getattr(state, "reserved_requests", None)
    return None if reserved is None else len(reserved)


def remember_revoked(task_id: str) -> None:
    """Add ``task_id`` to the worker's revoked tasks (no-op outside a worker)."""
    revoked = getattr(sys.modules.get(_STATE), "revoked", None)
    if revoked is not None:
        revoked.add(task_id)


def is_prefork(pool: Any) -> bool:
    """Whether ``pool`` is Celery's prefork pool (or a subclass of it)."""
    prefork = sys.modules.get("celery.concurrency.prefork")
    return prefork is not None and isinstance(pool, prefork.TaskPool)


def is_solo(pool: Any) -> bool:
    """Whether ``pool`` is Celery's solo pool."""
    solo = sys.modules.get("celery.concurrency.solo")
    return solo is not None and isinstance(pool, solo.TaskPool)
