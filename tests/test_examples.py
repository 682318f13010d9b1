"""Every example runs and checks its own outcome (exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.parent.name for p in (ROOT / "examples").glob("*/run.py"))


def test_every_scenario_is_here() -> None:
    assert EXAMPLES == [
        "batch_publish",
        "beat_sweep",
        "dead_letter_handler",
        "fair_lanes",
        "flower",
        "quickstart",
    ]
    for name in EXAMPLES:
        assert (ROOT / "examples" / name / "README.md").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str, redis_url: str) -> None:
    env = {**os.environ, "EMQ_EXAMPLE_REDIS_URL": redis_url.rsplit("/", 1)[0] + "/14"}
    done = subprocess.run(
        [sys.executable, f"examples/{name}/run.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize("private", [False, True])
def test_the_demo_says_what_happens_to_the_job_it_leaves(
    private: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples import demo

    monkeypatch.setenv("EMQ_PRIVATE_REDIS_STARTED", "1" if private else "0")
    step = demo.last_step()
    if private:
        # A private Redis stops with the script: nothing is left to look at.
        assert "left in the morgue" not in step
        assert "stops with the demo" in step
    else:
        assert step == "6. one more poison task, left in the morgue for you to look at"


def test_the_demo_explains_what_cured_means() -> None:
    from examples import demo

    assert "once cured" not in demo.RETRY_STEP
    # The cure is a flag the task reads, standing for a fix deployed before a retry.
    assert "cured:poison" in demo.RETRY_STEP and "fix" in demo.RETRY_STEP
