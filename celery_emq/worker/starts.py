"""Start records and early acks, sent from where the claim is held.

A lapsed claim is charged a stall only when its task had started: a worker
killed with prefetched tasks requeues those uncounted. Under solo, threads,
gevent and eventlet the task runs in the process that holds its claim, and
the record (with the acks queued so far) is sent from ``task_prerun``; a
prefork child holds no claim, and its worker records the start when it hears
the child accepted the job (:func:`note_accepted`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_prerun, task_success

from celery_emq.transport.lease import delivery_tag, keeper, parse_tag
from celery_emq.transport.settle import batcher
from celery_emq.worker import hooks, marks

__all__ = ["ack_success", "install", "note_accepted", "record_start", "request_claim"]

logger = logging.getLogger(__name__)


def request_claim(request: Any) -> tuple[str, str] | None:
    """Return the claim (job id, token) a task's request was delivered under, if any.

    The claim's one carrier is the delivery tag (``<job id>#<token>``, see
    :mod:`celery_emq.transport.lease`), which kombu keeps in the message's
    properties. Celery hands those properties to the task as
    ``request.properties``, in the worker's main process and in a prefork child
    alike (Celery 5.4 to 5.7), so no header is added to the message.
    """
    properties = getattr(request, "properties", None)
    tag = properties.get("delivery_tag") if isinstance(properties, dict) else None
    return parse_tag(tag) if isinstance(tag, str) else None


def note_accepted(request: Any) -> None:
    """Record, in the worker, the start of a job a prefork child accepted.

    The child tells the worker when it accepts a job, before it runs the task
    (``Request.on_accepted``); the worker records the start then, queued with
    its acks (see settle.py), instead of the child making a round trip of its
    own before every task. A child that dies under its task does not need the
    record: the worker charges that claim a stall itself (``worker_lost``).
    """
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    if not isinstance(tag, str):
        return
    if marks.submitted_job(tag) is None:
        # Not a prefork job: its task records its own start before its body runs.
        return
    claim = keeper().get(tag)
    if claim is not None:
        batcher().start(claim)


def record_start(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    """Record a task's start before its body runs, where its claim is held (``task_prerun``)."""
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
        return


def ack_success(sender: Any = None, **kwargs: Any) -> None:
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
    batcher().ack_tags([delivery_tag(job_id, token)])


def install() -> None:
    """Record starts from ``task_prerun`` and ``on_accepted``; ack early from ``task_success``."""
    task_prerun.connect(record_start, weak=False, dispatch_uid="celery_emq.record_start")
    task_success.connect(ack_success, weak=False, dispatch_uid="celery_emq.ack_success")
    hooks.wrap_on_accepted(note_accepted)
