"""What the worker's pool was handed, and how eagerly a busy worker claims more.

Celery's threads pool queues what it is handed in its executor, and gevent
and eventlet spawn it: when the connection drops, Celery cancels none of it,
so those tasks still run, on the claims they were delivered with. The prefork
pool drops what it had not yet written to a child (``flush``), but a child
runs what was written to its pipe: such a job counts once written. Every pool
is handed a task through ``apply_async``, which notes the delivery
(:mod:`celery_emq.worker.marks`) so its claim stays held.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from celery_emq.transport.lease import keeper
from celery_emq.transport.settle import batcher
from celery_emq.worker import hooks, marks

__all__ = ["claim_at_once", "install", "on_worker_ready", "submit"]

#: The pool of the Celery worker running in this process, once it is ready.
_pool: Any = None


def submit(pool: Any, request: Any, celerys_own: Callable[[], Any]) -> Any:
    """Hand a request to the pool (``celerys_own()``), noting its delivery as submitted."""
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    tag = tag if isinstance(tag, str) else ""
    prefork = hooks.is_prefork(pool)
    if tag and not prefork:
        marks.submit(tag)
    try:
        job = celerys_own()
    except BaseException:
        if tag:
            marks.settled(tag)
        raise
    if tag and prefork and job is not None:
        marks.submit(tag, job)
    elif tag:
        _give_back_if_cancelled(job, tag)
    return job


def _give_back_if_cancelled(job: Any, tag: str) -> None:
    """Release the claim of a task the threads pool cancels before it starts.

    A warm shutdown of the threads pool (Celery 5.7; 5.4 runs them first)
    cancels the tasks still queued in its executor, not yet accepted: they never
    run, yet they were kept held as submitted when the channel closed. Their
    claims go back at once, uncounted, as every other unstarted delivery of a
    warm shutdown does, instead of waiting a lease (and counting a lapse)
    after the process exits.
    """
    future = hooks.threads_future(job)
    if future is None:
        return

    def done(f: Future[Any]) -> None:
        if f.cancelled():
            marks.settled(tag)
            keeper().release(tag)

    future.add_done_callback(done)


def on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
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
    reserved = hooks.reserved_count()
    if not isinstance(limit, int) or limit <= 0 or reserved is None:
        return True
    if not (hooks.is_prefork(pool) or hooks.is_solo(pool)):
        return True
    return reserved <= limit


def tasks_run_here() -> bool:
    """Whether tasks run in this process (solo, threads, gevent, eventlet), not in children."""
    return not hooks.is_prefork(_pool)


def install() -> None:
    """Note every delivery handed to the pool; keep written prefork jobs on a reconnect.

    And count a prefork child's ``ACK`` still in its pipe when it died, so the
    job is reported lost rather than run again on the same delivery.
    """
    hooks.wrap_apply_async(submit)
    hooks.keep_started_jobs_on_flush()
    hooks.read_acks_before_put_back()
