"""The ``celery_emq.sweep`` task and the one-line helper that schedules it with beat.

::

    import celery_emq
    celery_emq.schedule_sweep(app, every_s=30)

adds a beat entry that runs ``celery_emq.sweep`` every 30 s (each run expires
after the same 30 s, so runs missed while no worker was free do not pile up),
and makes workers import this module so the task is registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import shared_task

from celery_emq.ops.appstore import open_store
from celery_emq.transport.sweeper import Sweeper
from celery_emq.worker.follow_up import CeleryFollowUp

__all__ = ["SWEEP_TASK", "open_store", "schedule_sweep", "sweep"]

SWEEP_TASK = "celery_emq.sweep"


@shared_task(name=SWEEP_TASK, bind=True)
def sweep(self: Any, queues: Sequence[str] | None = None, reap: bool = False) -> dict[str, Any]:
    """Sweep (or, with ``reap``, reap) every registered queue, or ``queues``.

    Returns a report per queue: recovered, dead and reaped job ids, trimmed count.
    """
    with open_store(self.app) as (store, options):
        node = getattr(self.request, "hostname", None)
        reports = Sweeper(store, options, CeleryFollowUp(self.app, node)).run(queues or (), reap)
        return {r.queue: r.as_dict() for r in reports}


def schedule_sweep(
    app: Any, every_s: float = 30.0, queues: Sequence[str] | None = None
) -> dict[str, Any]:
    """Schedule ``celery_emq.sweep`` with beat every ``every_s`` seconds.

    Also adds this module to ``app.conf.include`` so workers register the task.
    Returns the beat entry it added.
    """
    if not every_s > 0:
        raise ValueError(f"every_s must be > 0, not {every_s!r}")
    entry = {
        "task": SWEEP_TASK,
        "schedule": float(every_s),
        "args": (list(queues) if queues else None,),
        "options": {"expires": float(every_s)},
    }
    schedule = dict(app.conf.beat_schedule or {})
    schedule[SWEEP_TASK] = entry
    app.conf.beat_schedule = schedule
    include = list(app.conf.include or ())
    if __name__ not in include:
        app.conf.include = [*include, __name__]
    return entry
