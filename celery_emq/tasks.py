"""The ``celery_emq.sweep`` task: the path users name in ``include``.

See :mod:`celery_emq.ops.tasks`.

This path is stored outside the code (in apps' ``include`` settings) and is
kept for good.
"""

from __future__ import annotations

from celery_emq.ops.tasks import SWEEP_TASK, open_store, schedule_sweep, sweep

__all__ = ["SWEEP_TASK", "open_store", "schedule_sweep", "sweep"]
