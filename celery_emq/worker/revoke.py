"""Revoked tasks brought out of the broker's delayed sets (Celery's ``revoke`` command).

Celery remembers a revoke only in its workers' memory, for a few hours; a task
delayed in the broker may be due long after. On a revoke, each worker promotes
the delayed jobs of those task ids at once, marked revoked: the worker that
claims one discards it as Celery discards a revoked task (the transport adds
the id to the worker's revoked tasks, :meth:`CeleryHost.revoked`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery_emq.worker import hooks

__all__ = ["install", "on_revoke", "promote_revoked"]

logger = logging.getLogger(__name__)


def promote_revoked(app: Any, task_ids: list[str]) -> int:
    """Promote the delayed jobs of ``task_ids`` in every registered queue; return how many."""
    store = _child_store(app)
    if store is None or not task_ids:
        return 0
    return sum(store.promote_tasks(q, task_ids) for q in store.queues())


def on_revoke(app: Any, task_ids: list[str]) -> None:
    """After Celery's ``revoke`` ran: promote the revoked tasks' delayed jobs."""
    try:
        promote_revoked(app, task_ids)
    except Exception:
        logger.warning(
            "celery_emq: could not bring revoked tasks out of the delayed set", exc_info=True
        )


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


def install() -> None:
    """Follow Celery's ``revoke`` remote command with :func:`on_revoke` (once per process)."""
    hooks.wrap_revoke(on_revoke)
