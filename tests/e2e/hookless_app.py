"""The end-to-end app on a Celery whose ``Request`` lost ``on_failure`` (tests/e2e/test_hooks.py).

Removed before the worker starts, as a Celery release that renamed it would.
"""

from __future__ import annotations

from celery.worker.request import Request

from tests.e2e.app import app

__all__ = ["app"]

del Request.on_failure
