"""What a Celery worker in this process is running, read without importing it eagerly."""

from __future__ import annotations

import sys

__all__ = ["started_delivery_tags"]


def started_delivery_tags() -> set[str]:
    """Return the delivery tags of tasks this worker process has started.

    Empty outside a Celery worker. Read from ``celery.worker.state`` only when
    that module is already loaded, so a plain kombu client pays nothing.
    """
    state = sys.modules.get("celery.worker.state")
    if state is None:
        return set()
    tags: set[str] = set()
    for request in list(getattr(state, "active_requests", ())):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag is not None:
            tags.add(tag)
    return tags
