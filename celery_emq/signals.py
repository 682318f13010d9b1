"""Signals the sweep sends, declared as Celery declares its own.

Connect handlers exactly as to Celery's signals::

    from celery_emq.signals import job_dead_lettered

    @job_dead_lettered.connect
    def alert(sender, job, **kwargs):
        ...

Every signal is sent by the process that ran the sweep (a worker's sweep timer,
the ``celery_emq.sweep`` task, or ``celery emq sweep``), with ``sender`` the
task name and ``job`` a :class:`celery_emq.transport.jobs.JobInfo` (task name, id, args,
kwargs, queue, group, stall count, reason). A handler that raises is logged and
never breaks the sweep.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["job_dead_lettered", "job_recovered", "job_stalled"]

#: A job's lease lapsed (or its worker process was lost): one stall counted.
job_stalled = Signal(name="job_stalled", providing_args={"job"})

#: A stalled job went back to the front of its queue, within its budget.
job_recovered = Signal(name="job_recovered", providing_args={"job"})

#: A job was moved to the morgue: it stalled past its budget (``job.reason`` is
#: ``lease_expired`` or ``worker_lost``), or it cannot or will not run
#: (``malformed``, ``unknown_task``, ``invalid_task``, ``rejected``, ...).
job_dead_lettered = Signal(name="job_dead_lettered", providing_args={"job"})
