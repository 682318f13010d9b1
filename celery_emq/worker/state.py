"""What a Celery worker in this process is doing, read without importing it eagerly.

Celery settles some deliveries with an ordinary ``ack`` or ``reject`` that says
nothing of why: a pool process died under the task, the body could not be
decoded, the task is not registered. The probes installed here wrap the Celery
methods that decide those outcomes and *mark* the delivery tag with a reason;
when the settle reaches the transport, it reads the mark and counts a stall
(``worker_lost``) or dead-letters the job with that reason instead of deleting it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from celery import current_app

from celery_emq.store.outcomes import UNSET
from celery_emq.transport import process
from celery_emq.transport.lease import delivery_tag, keeper, parse_tag
from celery_emq.transport.messages import BUDGET_OPTION
from celery_emq.transport.process import WORKER_LOST, Mark
from celery_emq.transport.settle import batcher

__all__ = [
    "Mark",
    "claim_at_once",
    "install_worker_probes",
    "pop_mark",
    "request_claim",
    "settled",
    "started_delivery_tags",
    "worker_nodename",
]

logger = logging.getLogger(__name__)

#: Marked delivery tags waiting for Celery's (possibly deferred) ack or reject.
#: Bounded: an entry nobody settles is forgotten eventually.
_marks: OrderedDict[str, Mark] = OrderedDict()
_marks_lock = threading.Lock()
_MARKS_MAX = 10_000

#: Delivery tags handed to a pool that runs whatever it was handed (threads,
#: solo, gevent, eventlet): such a task runs even when the channel closes before
#: it starts, so its claim must stay held. Removed when the delivery is settled.
#: Each maps to the pool's result for a prefork job (it runs once written to a
#: child), or to None (it runs, whatever happens).
_submitted: dict[str, Any] = {}
_submitted_lock = threading.Lock()


def started_delivery_tags() -> set[str]:
    """Return the delivery tags of tasks this worker process has started, or will.

    Started: Celery's active requests. Will start: handed to a pool that runs
    what it was handed whatever happens to the channel. Empty outside a Celery
    worker. Read from ``celery.worker.state`` only when that module is already
    loaded, so a plain kombu client pays nothing.
    """
    state = sys.modules.get("celery.worker.state")
    if state is None:
        return set()
    with _submitted_lock:
        tags = {tag for tag, job in _submitted.items() if job is None or _written(job)}
    for request in list(getattr(state, "active_requests", ())):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag is not None:
            tags.add(tag)
    return tags


def settled(tag: str) -> None:
    """Forget a delivery handed to the pool: it was acked or rejected."""
    with _submitted_lock:
        _submitted.pop(tag, None)


def pop_mark(tag: str) -> Mark | None:
    """Return (and forget) the mark on ``tag``, if Celery's handling left one."""
    with _marks_lock:
        return _marks.pop(tag, None)


def _mark(message: Any, reason: str, error: str = "") -> None:
    tag = getattr(message, "delivery_tag", None)
    if tag is None:
        return
    with _marks_lock:
        _marks[tag] = Mark(reason, error)
        while len(_marks) > _MARKS_MAX:
            _marks.popitem(last=False)


def _error(exc: Any) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else ""


def _wrap(cls: Any, name: str, before: Callable[..., None]) -> None:
    """Call ``before(self, *args)`` ahead of ``cls.name``; once per process."""
    original = getattr(cls, name)
    if getattr(original, "_emq_probe", False):
        return

    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        before(self, *args)
        return original(self, *args, **kwargs)

    probe._emq_probe = True  # type: ignore[attr-defined]
    setattr(cls, name, probe)


def install_worker_probes() -> None:
    """Install the probes, once per process, and only inside a Celery worker.

    A lost pool process is a stall, whatever ``task_reject_on_worker_lost``
    says: an ``acks_late`` task's delivery is requeued as that setting would
    (no failure is recorded), and the transport turns the requeue into a
    counted recovery, or a dead-letter past the budget; with
    ``task_retry_on_worker_lost`` Celery's own retry decides instead. A message
    Celery cannot decode (it would ack it away) or will not run (an unknown or
    invalid task, which it rejects) is dead-lettered with that reason.
    """
    if "celery.worker.consumer" not in sys.modules:
        return  # not inside a Celery worker
    from celery.worker.consumer.consumer import Consumer

    _wrap(
        Consumer,
        "on_decode_error",
        lambda self, message, exc: _mark(message, "malformed", _error(exc)),
    )
    _wrap(
        Consumer,
        "on_unknown_message",
        lambda self, body, message: _mark(message, "unknown_message"),
    )
    _wrap(
        Consumer,
        "on_unknown_task",
        lambda self, body, message, exc: _mark(message, "unknown_task", _error(exc)),
    )
    _wrap(
        Consumer,
        "on_invalid_task",
        lambda self, body, message, exc: _mark(message, "invalid_task", _error(exc)),
    )
    _wrap(Consumer, "start", lambda self: _note_nodename(self.hostname))
    # A worker run inside another process (a test's) leaves no node behind.
    _wrap(Consumer, "shutdown", lambda self: _forget_nodename(self.hostname))
    _install_worker_lost_probe()
    _install_revoke_probe()
    _install_start_recorder()
    _install_submit_probe()
    _install_accept_probe()
    keep_started_jobs_on_flush()


def keep_started_jobs_on_flush() -> None:
    """Keep the prefork pool's jobs a child has, or will run, when the connection drops.

    On a broker reconnect Celery empties the prefork pool's job table
    (``AsynPool.flush``): before 5.6.3 of every job, since of every job a child
    has not yet acknowledged starting. But a job already written to a child's
    pipe (``_write_to``) is read and run by that child all the same, and its
    task then finishes unseen by the worker, which never acks it: under
    kombu's ``redis://`` the message was requeued at the reconnect and runs
    twice; here its claim, kept for the started task, would stay leased for
    ever. Jobs a child accepted or was written are kept; only those still in
    the outgoing buffer (no child will see them) are dropped. Installed once
    per process.
    """
    from celery.concurrency.asynpool import AsynPool

    flush = AsynPool.flush
    if getattr(flush, "_emq_compat", False):
        return

    def flush_keeping_started(self: Any) -> Any:
        kept = {
            key: job
            for key, job in self._cache.items()
            if job._accepted or getattr(job, "_write_to", None) is not None
        }
        try:
            return flush(self)
        finally:
            for key, job in kept.items():
                self._cache.setdefault(key, job)

    flush_keeping_started._emq_compat = True  # type: ignore[attr-defined]
    AsynPool.flush = flush_keeping_started


_nodename: str | None = None


def _note_nodename(hostname: Any) -> None:
    global _nodename
    if isinstance(hostname, str) and hostname:
        _nodename = hostname


def _forget_nodename(hostname: Any) -> None:
    global _nodename
    if _nodename == hostname:
        _nodename = None


def worker_nodename() -> str | None:
    """This worker's node name (``celery@host``), once its consumer started; else ``None``.

    Known in the worker's main process (where the transport claims, renews and
    sweeps), not in pool processes forked before the consumer started.
    """
    return _nodename


def _written(job: Any) -> bool:
    """Whether a prefork job reached a child (written to its pipe, or accepted)."""
    return bool(getattr(job, "_accepted", False)) or getattr(job, "_write_to", None) is not None


def _is_prefork(pool: Any) -> bool:
    """Whether ``pool`` is Celery's prefork pool (or a subclass of it)."""
    prefork = sys.modules.get("celery.concurrency.prefork")
    return prefork is not None and isinstance(pool, prefork.TaskPool)


def _install_submit_probe() -> None:
    """Note the deliveries handed to a pool that will run them come what may.

    Celery's threads pool queues what it is handed in its executor, and gevent
    and eventlet spawn it: when the connection drops, Celery cancels none of it,
    so those tasks still run, on the claims they were delivered with. The
    prefork pool drops what it had not yet written to a child (``flush``), but
    a child runs what was written to its pipe: such a job counts once written.
    Every pool is handed a task through ``apply_async`` with the request's
    ``on_accepted`` callback.
    """
    from celery.concurrency.base import BasePool

    original = BasePool.apply_async
    if getattr(original, "_emq_probe", False):
        return

    def apply_async(self: Any, target: Any, *args: Any, **options: Any) -> Any:
        request = getattr(options.get("accept_callback"), "__self__", None)
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        tag = tag if isinstance(tag, str) else ""
        prefork = _is_prefork(self)
        if tag and not prefork:
            with _submitted_lock:
                _submitted[tag] = None
        try:
            job = original(self, target, *args, **options)
        except BaseException:
            if tag:
                settled(tag)
            raise
        if tag and prefork and job is not None:
            with _submitted_lock:
                _submitted[tag] = job
        elif tag:
            _give_back_if_cancelled(job, tag)
        return job

    apply_async._emq_probe = True  # type: ignore[attr-defined]
    BasePool.apply_async = apply_async


def _give_back_if_cancelled(job: Any, tag: str) -> None:
    """Release the claim of a task the threads pool cancels before it starts.

    A warm shutdown of the threads pool (Celery 5.7; 5.4 runs them first)
    cancels the tasks still queued in its executor, not yet accepted: they never
    run, yet they were kept held as submitted when the channel closed. Their
    claims go back at once, uncounted, as every other unstarted delivery of a
    warm shutdown does, instead of waiting a lease (and counting a lapse)
    after the process exits.
    """
    future = getattr(job, "f", None)  # the threads pool's ApplyResult
    if not isinstance(future, Future):
        return

    def done(f: Future[Any]) -> None:
        if f.cancelled():
            settled(tag)
            keeper().release(tag)

    future.add_done_callback(done)


def _install_worker_lost_probe() -> None:
    from billiard.exceptions import WorkerLostError
    from celery.worker.request import Request

    if getattr(Request.on_failure, "_emq_probe", False):
        return
    original = Request.on_failure

    def on_failure(self: Any, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        lost = isinstance(exc, WorkerLostError) or (
            isinstance(exc, SystemExit | KeyboardInterrupt)
            and not getattr(self, "_already_cancelled", False)
            and not getattr(self, "_already_revoked", False)
        )
        task = self.task
        if getattr(self, "_already_cancelled", False) and task.acks_late:
            # Celery cancelled the task because the broker connection was lost,
            # and leaves the message unsettled for the broker to redeliver: let
            # the claim go back now rather than keep it renewed for ever.
            try:
                return original(self, exc_info, *args, **kwargs)
            finally:
                keeper().release(self.message.delivery_tag)
        if not lost or not task.acks_late or getattr(task, "retry_on_worker_lost", False):
            # With retry_on_worker_lost Celery publishes a retry and acks this
            # delivery: its retries (max_retries) bound the task, not the stall
            # budget, so the ack stays a plain ack.
            return original(self, exc_info, *args, **kwargs)
        success_was_stored = getattr(self, "_success_was_stored", None)
        if success_was_stored is not None and success_was_stored():
            return original(self, exc_info, *args, **kwargs)  # it finished: a plain ack
        # What Celery does with reject_on_worker_lost, done for this request
        # alone: the shared task object is never touched. The requeue reaches
        # the transport marked, and becomes a counted stall.
        from celery.worker.state import task_ready

        task_ready(self)
        _mark(self.message, WORKER_LOST, _error(exc))
        self.reject(requeue=True)
        return None

    on_failure._emq_probe = True  # type: ignore[attr-defined]
    Request.on_failure = on_failure


def _install_revoke_probe() -> None:
    """Bring revoked tasks out of the broker's delayed sets (Celery's ``revoke`` command).

    Celery remembers a revoke only in its workers' memory, for a few hours; a
    task delayed in the broker may be due long after. On a revoke, each worker
    promotes the delayed jobs of those task ids at once, marked revoked: the
    worker that claims one discards it as Celery discards a revoked task.
    """
    from celery.worker.control import Panel

    original = Panel.data.get("revoke")
    if original is None or getattr(original, "_emq_probe", False):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        try:
            promote_revoked(state.app, [str(i) for i in ids])
        except Exception:
            logger.warning(
                "celery_emq: could not bring revoked tasks out of the delayed set", exc_info=True
            )
        return reply

    revoke._emq_probe = True  # type: ignore[attr-defined]
    Panel.data["revoke"] = revoke


def promote_revoked(app: Any, task_ids: list[str]) -> int:
    """Promote the delayed jobs of ``task_ids`` in every registered queue; return how many."""
    store = _child_store(app)
    if store is None or not task_ids:
        return 0
    return sum(store.promote_tasks(q, task_ids) for q in store.queues())


def _install_accept_probe() -> None:
    """Record, in the worker, the start of a job a prefork child accepted.

    The child tells the worker when it accepts a job, before it runs the task
    (``Request.on_accepted``); the worker records the start then, queued with
    its acks (see settle.py), instead of the child making a round trip of its
    own before every task. A child that dies under its task does not need the
    record: the worker charges that claim a stall itself (``worker_lost``).
    """
    from celery.worker.request import Request

    _wrap(Request, "on_accepted", lambda self, *args: _note_accepted(self))


def _note_accepted(request: Any) -> None:
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    if not isinstance(tag, str):
        return
    with _submitted_lock:
        job = _submitted.get(tag)
    if job is None:
        # Not a prefork job: its task records its own start before its body runs.
        return
    claim = keeper().get(tag)
    if claim is not None:
        batcher().start(claim)
        keeper().started(tag)


def _install_start_recorder() -> None:
    """Record that a claim's task started, before its body runs, where the claim is held.

    A lapsed claim is charged a stall only when its task had started: a worker
    killed with prefetched tasks requeues those uncounted. Under solo, threads,
    gevent and eventlet the task runs in the process that holds its claim, and
    the record (with the acks queued so far) is sent from ``task_prerun``; a
    prefork child holds no claim, and its worker records the start when it
    hears the child accepted the job (:func:`_install_accept_probe`).
    """
    global _start_recorder_installed
    if _start_recorder_installed:
        return
    from celery.signals import task_prerun, task_success, worker_ready

    task_prerun.connect(_record_start, weak=False, dispatch_uid="celery_emq.record_start")
    task_success.connect(_ack_success, weak=False, dispatch_uid="celery_emq.ack_success")
    worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="celery_emq.worker_ready")
    _start_recorder_installed = True


_start_recorder_installed = False


#: The pool of the Celery worker running in this process, once it is ready.
_pool: Any = None


def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """Note the worker's pool; let settles wait for company (``settle_delay_ms``)."""
    global _pool
    _pool = getattr(sender, "pool", None)
    batcher().deferring = True


def claim_at_once() -> bool:
    """Whether a free prefetch slot is to be filled now, not together with others.

    Not when a ready prefork or solo worker runs here and holds more runnable
    tasks (received and not finished, ETA tasks waiting in the timer left out:
    Celery's ``reserved_requests``) than its pool runs at once: no pool process
    can idle then. Only these pools wake the worker's event loop when a task
    finishes (prefork through its result pipes; solo runs tasks in the loop),
    so a claim put off now is sure to be made soon. Threads, gevent and
    eventlet claim whenever a slot is free.
    """
    pool = _pool
    limit = getattr(pool, "limit", None)
    state = sys.modules.get("celery.worker.state")
    solo = sys.modules.get("celery.concurrency.solo")
    if not isinstance(limit, int) or limit <= 0 or state is None:
        return True
    if not (_is_prefork(pool) or (solo is not None and isinstance(pool, solo.TaskPool))):
        return True
    return len(getattr(state, "reserved_requests", ())) <= limit


def request_claim(request: Any) -> tuple[str, str] | None:
    """Return the claim (job id, token) a task's request was delivered under, if any.

    The claim's one carrier is the delivery tag (``<job id>#<token>``, see
    :mod:`celery_emq.lease`), which kombu keeps in the message's properties.
    Celery hands those properties to the task as ``request.properties``, in the
    worker's main process and in a prefork child alike (Celery 5.4 to 5.7), so
    no header is added to the message.
    """
    properties = getattr(request, "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    return parse_tag(tag) if isinstance(tag, str) else None


def _record_start(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    claim = request_claim(getattr(task, "request", None))
    if claim is None:
        return
    job_id, token = claim
    tag = delivery_tag(job_id, token)
    held = keeper().get(tag)
    if held is None:
        # A prefork child (its worker records the start, see on_accepted), or
        # a claim already settled (a task acked before it runs).
        return
    keeper().started(tag)
    try:
        batcher().start_now(held)
    except Exception:
        logger.warning(
            "celery_emq: could not record the start of job %s in %s; if its worker "
            "dies now, the job is requeued without counting a stall",
            job_id,
            held.queue,
            exc_info=True,
        )


def _ack_success(sender: Any = None, **kwargs: Any) -> None:
    """Ack a succeeded ``acks_late`` task whose claim this very process holds.

    Under solo, threads or gevent a task runs in the process that holds its
    claim, and Celery defers its ack to the next turn of the event loop: a
    whole claimed batch can run before any of its acks is sent. A task later
    in the batch that kills the worker would then leave the earlier, finished
    tasks to be charged a stall and run again. The ack is queued here, from
    Celery's ``task_success`` (sent only once the result is stored), and the
    next task's start record carries it to Redis before that task's body runs
    (or the batcher sends it within ``settle_delay_ms``); Celery's own ack then
    has nothing left to do. (A prefork child does not hold the claim; its
    worker acks as soon as the result comes back.)
    """
    task = sender
    if not getattr(task, "acks_late", False):
        return
    claim = request_claim(getattr(task, "request", None))
    if claim is None:
        return
    job_id, token = claim
    held = keeper().forget(delivery_tag(job_id, token))
    if held is not None:
        batcher().ack([held])


_child_stores: dict[int, Any] = {}


def _child_store(app: Any) -> Any:
    """Return a job store of this process's own, opened once from the app's broker.

    For what a process does outside the claims it holds (a revoke's promotion).
    """
    entry = _child_stores.get(id(app))
    if entry is None:
        from celery_emq.transport.channel import Channel

        conn = app.connection_for_write()
        channel = conn.default_channel
        store = channel.store if isinstance(channel, Channel) else None
        entry = _child_stores[id(app)] = (conn, store)
    return entry[1]


def _forget_child_stores() -> None:
    _child_stores.clear()


os.register_at_fork(after_in_child=_forget_child_stores)


class CeleryHost:
    """What a Celery worker in this process tells the transport (:class:`process.Host`)."""

    def started_delivery_tags(self) -> set[str]:
        return started_delivery_tags()

    def nodename(self) -> str | None:
        return worker_nodename()

    def claim_at_once(self) -> bool:
        return claim_at_once()

    def pop_mark(self, tag: str) -> Mark | None:
        return pop_mark(tag)

    def settled(self, tag: str) -> None:
        settled(tag)

    def task_budget(self, task_name: str) -> object:
        try:
            task = current_app.tasks.get(task_name)
        except Exception:
            return UNSET
        return getattr(task, BUDGET_OPTION, UNSET) if task is not None else UNSET

    def revoked(self, task_id: str) -> None:
        # Celery keeps revokes in memory (3 hours by default): a worker that
        # started later, or forgot, learns it here, before the message reaches Celery.
        state = sys.modules.get("celery.worker.state")
        if state is not None:
            state.revoked.add(task_id)


def attach() -> None:
    """Tell the transport about the Celery worker in this process, once it has one.

    The transport asks the :class:`CeleryHost` what a worker knows; the probes
    are installed when a worker initialises (Celery's ``worker_init``) or, in a
    process whose worker started before the transport was imported, when a
    transport starts. Outside a worker nothing is installed.
    """
    from celery.signals import worker_init

    process.set_host(CeleryHost())
    process.on_transport_start(install_worker_probes)
    worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_emq.worker_init")


def _on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    install_worker_probes()
