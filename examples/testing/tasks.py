"""The tasks under test: ordinary ``shared_task`` code, nothing emq-specific."""

from __future__ import annotations

import os
import threading

from celery import shared_task

#: Set by a test to let a stuck ``poison`` task return.
released = threading.Event()


@shared_task(name="shop.add")
def add(x: int, y: int) -> int:
    return x + y


@shared_task(name="shop.poison", acks_late=True, emq_max_stalled=0)
def poison() -> str:
    """A task that never finishes while the test watches, as one that kills its worker.

    ``acks_late``: its job stays leased in the broker while it runs (an early
    ack would delete it as it starts); ``emq_max_stalled=0``: its first stall
    dead-letters it.
    """
    released.wait(timeout=30)
    return "released"


@shared_task(name="shop.crash", acks_late=True, emq_max_stalled=0)
def crash() -> None:
    """A task that kills the process running it, as a segfault or the OOM killer would."""
    os._exit(1)
