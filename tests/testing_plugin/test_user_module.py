"""A user's test module, using only the documented fixtures, runs on emq:// without Docker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_example_test_module_passes(redis_url: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "examples/testing",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'pt'}",
        ],
        cwd=ROOT,
        env={**os.environ, "EMQ_TEST_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "4 passed" in out, out[-3000:]
