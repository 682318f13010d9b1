"""The ``celery_emq.sweep`` task and the one-line helper that schedules it with beat.

::

    import celery_emq
    celery_emq.schedule_sweep(app, every_s=30)

adds a beat entry that runs ``celery_emq.sweep`` every 30 s (each run expires
after the same 30 s, so runs missed while no worker was free do not pile up),
and makes workers import this module so the task is registered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from celery import shared_task

from celery_emq.errors import EmqError
from celery_emq.options import EmqOptions
from celery_emq.store.jobstore import JobStore
from celery_emq.transport.sweeper import Sweeper

__all__ = ["SWEEP_TASK", "open_store", "schedule_sweep", "sweep"]

SWEEP_TASK = "celery_emq.sweep"


@contextmanager
def open_store(app: Any) -> Iterator[tuple[JobStore, EmqOptions]]:
    """Open the app's broker and yield its job store and options.

    Raises:
        EmqError: the app's broker is not an emq:// transport.
    """
    from celery_emq.transport.channel import Channel

    # kombu retries refused credentials as it retries an unreachable broker
    # (about 6 s by default): they are reported at once instead.
    with app.connection_for_write(transport_options={"errback": _credentials_refused}) as conn:
        channel = conn.default_channel
        if not isinstance(channel, Channel):
            raise EmqError(
                f"the broker {conn.as_uri()} is not a celery_emq transport "
                "(use an emq:// URL, or broker_transport='celery_emq.transport:Transport')"
            )
        yield channel.store, channel.emq


def _credentials_refused(exc: BaseException, _interval: float) -> None:
    """Stop kombu's connection retries when the broker refused the credentials."""
    if isinstance(exc, redis.AuthenticationError):
        raise exc


@shared_task(name=SWEEP_TASK, bind=True)
def sweep(self: Any, queues: Sequence[str] | None = None, reap: bool = False) -> dict[str, Any]:
    """Sweep (or, with ``reap``, reap) every registered queue, or ``queues``.

    Returns a report per queue: recovered, dead and reaped job ids, trimmed count.
    """
    with open_store(self.app) as (store, options):
        node = getattr(self.request, "hostname", None)
        reports = Sweeper(store, options, app=self.app, node=node).run(queues or (), reap)
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
