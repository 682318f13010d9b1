"""The Celery worker in this process: its hooks installed, checked, and told to the transport.

:func:`attach` (run when ``celery_emq`` is imported) registers a
:class:`CeleryHost` with the transport and asks to hear when a worker
initialises (Celery's ``worker_init``) or a transport starts inside one; then
:func:`install_worker_probes` checks every hook of :mod:`celery_emq.worker.hooks`
on the running Celery and installs them. A producer, Flower, or any process
that runs no worker installs and checks nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from celery import current_app
from celery.signals import worker_init, worker_ready

from celery_emq.errors import CeleryHookMissingError
from celery_emq.store.outcomes import UNSET
from celery_emq.transport import process
from celery_emq.transport.messages import BUDGET_OPTION
from celery_emq.transport.process import Mark
from celery_emq.worker import hooks, lost, marks, pool, revoke, starts
from celery_emq.worker.marks import pop_mark, settled, started_delivery_tags
from celery_emq.worker.pool import claim_at_once
from celery_emq.worker.revoke import promote_revoked
from celery_emq.worker.starts import request_claim

__all__ = [
    "CeleryHost",
    "Mark",
    "attach",
    "claim_at_once",
    "install",
    "install_worker_probes",
    "pop_mark",
    "promote_revoked",
    "request_claim",
    "settled",
    "started_delivery_tags",
    "worker_nodename",
]

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


def in_worker() -> bool:
    """Whether a Celery worker runs in this process (its consumer module is loaded).

    A producer, Flower, or a plain kombu client never loads it.
    """
    return "celery.worker.consumer" in sys.modules


def install_worker_probes() -> None:
    """Check and install the hooks if a Celery worker runs in this process (see :func:`install`).

    Called as a transport starts: in a producer, Flower or a plain kombu
    client (no worker's consumer loaded), nothing is checked or installed.
    """
    if in_worker():
        install()


def install() -> None:
    """Check every hook on the running Celery, then install those not installed yet.

    A message Celery cannot decode (it would ack it away) or will not run (an
    unknown or invalid task, which it rejects) is dead-lettered with that
    reason; a lost pool process is a counted stall (:mod:`.lost`); starts are
    recorded (:mod:`.starts`); what the pool was handed stays held when the
    connection drops (:mod:`.pool`); a revoke reaches delayed jobs
    (:mod:`.revoke`).

    Raises:
        CeleryHookMissingError: a hook a guarantee needs is missing here.
    """
    hooks.verify()
    hooks.wrap_consumer(
        "on_decode_error",
        lambda self, message, exc: marks.mark(message, "malformed", marks.error_text(exc)),
    )
    hooks.wrap_consumer(
        "on_unknown_message", lambda self, body, message: marks.mark(message, "unknown_message")
    )
    hooks.wrap_consumer(
        "on_unknown_task",
        lambda self, body, message, exc: marks.mark(message, "unknown_task", marks.error_text(exc)),
    )
    hooks.wrap_consumer(
        "on_invalid_task",
        lambda self, body, message, exc: marks.mark(message, "invalid_task", marks.error_text(exc)),
    )
    hooks.wrap_consumer("start", lambda self: _note_nodename(self.hostname))
    # A worker run inside another process (a test's) leaves no node behind.
    hooks.wrap_consumer("shutdown", lambda self: _forget_nodename(self.hostname))
    lost.install()
    revoke.install()
    starts.install()
    worker_ready.connect(pool.on_worker_ready, weak=False, dispatch_uid="celery_emq.worker_ready")
    pool.install()


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
        hooks.remember_revoked(task_id)

    def tasks_run_here(self) -> bool:
        return pool.tasks_run_here()


def attach() -> None:
    """Tell the transport about the Celery worker in this process, once it has one.

    The transport asks the :class:`CeleryHost` what a worker knows; the probes
    are installed when a worker initialises (Celery's ``worker_init``) or, in a
    process whose worker started before the transport was imported, when a
    transport starts. Outside a worker nothing is installed or checked.
    """
    process.set_host(CeleryHost())
    process.on_transport_start(install_worker_probes)
    worker_init.connect(_on_worker_init, weak=False, dispatch_uid="celery_emq.worker_init")


def _on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    # Sent by a worker being built, before it loads its consumer: this is a
    # worker, whatever in_worker() says yet.
    try:
        install()
    except CeleryHookMissingError as exc:
        app = getattr(sender, "app", None)
        if app is None:
            raise
        _refuse_start(app, exc)


def _refuse_start(app: Any, error: CeleryHookMissingError) -> None:
    """Make the worker being built fail with ``error`` before it starts.

    Celery logs and swallows what a ``worker_init`` receiver raises; a worker
    bootstep that raises as the worker builds its steps stops it instead.
    """
    from celery import bootsteps

    class RefuseStart(bootsteps.Step):  # type: ignore[misc]
        name = "celery_emq.RefuseStart"

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            raise error

    app.steps["worker"].add(RefuseStart)
