"""A plain wheel install (no extras) into an empty venv runs a worker and the CLI.

The wheel is built from ``EMQ_WHEEL_SOURCE`` (default: this checkout), installed
alone into a fresh venv with pip, and exercised from a tiny app module there:
``celery emq status``, a ``celery worker`` that runs a task sent from this
process, and the imports of the transport and the CLI. A dependency that only
arrives through some extra (as kombu's ``packaging`` does) fails here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import celery_emq  # noqa: F401 - registers the emq:// scheme for the client app

ROOT = Path(__file__).resolve().parents[1]
#: The project the wheel is built from; point it at another checkout to check that one.
WHEEL_SOURCE = Path(os.environ.get("EMQ_WHEEL_SOURCE", str(ROOT)))
#: Building the wheel and installing it fetch from the package index.
PIP_TIMEOUT = 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * PIP_TIMEOUT + 300)]

PROJ = """\
import redis
from celery import Celery

import celery_emq  # registers emq://

REDIS = {redis_url!r}
PREFIX = {prefix!r}

app = Celery("proj", broker={broker_url!r})
app.conf.broker_transport_options = {{"global_keyprefix": PREFIX}}


@app.task(ignore_result=True)
def touch(token):
    redis.Redis.from_url(REDIS).set(PREFIX + "touched", token)
"""


@dataclass(frozen=True)
class Venv:
    """A venv holding the wheel and nothing else it did not pull in."""

    path: Path

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for the venv's processes: nothing leaks in from this interpreter."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
    }
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1", **extra)
    return env


def run(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=clean_env(), capture_output=True, text=True, timeout=timeout, **kwargs
    )


def output(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"


def wait_for(cond: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll ``cond`` until it is truthy or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """Build the wheel and install it, without extras, into an empty venv."""
    base = tmp_path_factory.mktemp("packaging")
    dist = base / "dist"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(WHEEL_SOURCE)],
        PIP_TIMEOUT,
    )
    assert built.returncode == 0, f"building the wheel from {WHEEL_SOURCE}:\n{output(built)}"
    wheels = sorted(dist.glob("celery_emq-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {dist}: {wheels}"

    env = Venv(base / "venv")
    made = run([sys.executable, "-m", "venv", str(env.path)], 120)
    assert made.returncode == 0, f"creating the venv:\n{output(made)}"
    installed = run([env.bin("python"), "-m", "pip", "install", str(wheels[0])], PIP_TIMEOUT)
    assert installed.returncode == 0, f"installing {wheels[0].name}:\n{output(installed)}"
    return env


@pytest.fixture
def app_dir(tmp_path: Path, redis_url: str, prefix: str) -> Path:
    """A directory holding ``proj.py``, a Celery app on emq:// under the test's prefix."""
    (tmp_path / "proj.py").write_text(
        PROJ.format(
            redis_url=redis_url,
            prefix=prefix,
            broker_url=redis_url.replace("redis://", "emq://", 1),
        )
    )
    return tmp_path


def test_transport_and_cli_import(venv: Venv, tmp_path: Path) -> None:
    done = run(
        [venv.bin("python"), "-c", "import celery_emq.transport.channel, celery_emq.ops.cli"],
        60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, output(done)


def test_page_templates_ship_and_the_exporter_names_its_extra(venv: Venv, app_dir: Path) -> None:
    shipped = run(
        [
            venv.bin("python"),
            "-c",
            "import importlib.resources as r, sys; "
            "t = r.files('celery_emq.ops') / 'templates' / 'emq'; "
            "print(sorted(p.name for p in t.iterdir())); "
            "print('prometheus_client' in sys.modules)",
        ],
        60,
        cwd=app_dir,
    )
    assert shipped.returncode == 0, output(shipped)
    assert shipped.stdout.split("\n")[:2] == ["['base.html', 'job.html', 'morgue.html']", "False"]
    # Without the metrics extra, the exporter says what to install.
    done = run(
        [venv.bin("celery"), "-A", "proj", "emq", "exporter", "--port", "0"], 60, cwd=app_dir
    )
    assert done.returncode != 0
    assert "pip install 'celery-emq[metrics]'" in done.stderr, output(done)


def test_emq_status_json(venv: Venv, app_dir: Path) -> None:
    done = run([venv.bin("celery"), "-A", "proj", "emq", "status", "--json"], 60, cwd=app_dir)
    assert done.returncode == 0, output(done)
    data = json.loads(done.stdout)
    assert isinstance(data["queues"], list), data


def test_worker_runs_a_task(
    venv: Venv, app_dir: Path, redis_url: str, prefix: str, client: redis.Redis
) -> None:
    log = app_dir / "worker.log"
    cmd = [
        venv.bin("celery"),
        "-A",
        "proj",
        "worker",
        "-P",
        "solo",
        "-l",
        "info",
        "--without-mingle",
        "--without-gossip",
    ]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=app_dir,
            env=clean_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text() -> str:
        return log.read_text(errors="replace")

    try:
        wait_for(lambda: " ready." in text() or proc.poll() is not None, 60)
        assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{text()[-3000:]}"
        assert " ready." in text(), f"the worker was not ready within 60 s:\n{text()[-3000:]}"

        token = uuid.uuid4().hex
        sender = Celery("sender", set_as_current=False)
        sender.conf.update(
            broker_url=redis_url.replace("redis://", "emq://", 1),
            broker_transport_options={"global_keyprefix": prefix},
        )
        try:
            sender.send_task("proj.touch", args=[token])
        finally:
            sender.close()

        touched = wait_for(lambda: client.get(prefix + "touched"), 30)
        assert touched == token.encode(), f"the task did not run:\n{text()[-3000:]}"
        assert wait_for(lambda: "succeeded" in text(), 10), text()[-3000:]
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Warm-stop the worker (SIGTERM), then SIGKILL its process group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(10)
