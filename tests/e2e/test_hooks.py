"""End to end: a worker whose Celery lacks a hook it needs refuses to start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from celery_emq.worker.hooks import HOOKS

from .harness import ROOT

pytestmark = pytest.mark.slow


def test_a_worker_missing_a_hook_stops_before_it_consumes(e2e_env: dict[str, str]) -> None:
    [hook] = [h for h in HOOKS if h.name == "Request.on_failure"]
    done = subprocess.run(
        [
            *(sys.executable, "-m", "celery", "-A", "tests.e2e.hookless_app", "worker"),
            *("-P", "solo", "-l", "info", "--without-mingle", "--without-gossip"),
        ],
        cwd=ROOT,
        env={**os.environ, **e2e_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "CeleryHookMissingError" in out, out[-3000:]
    assert f"lacks Request.on_failure (absent), which keeps this guarantee: {hook.guarantee}" in out
    assert "celery 5." in out and "kombu 5." in out
    assert " ready." not in out
