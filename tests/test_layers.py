"""The layers: paths stored outside the code keep their homes; imports point only down."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


#: Flat module paths of a layout that lived a few days and was never released.
UNRELEASED = ("celery_emq.status", "celery_emq.sweeper", "celery_emq.jobs", "celery_emq.flower")


@pytest.mark.parametrize("old", UNRELEASED)
def test_no_path_of_the_unreleased_flat_layout_imports(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_importing_the_package_installs_no_import_hook() -> None:
    import celery_emq

    assert not [f for f in sys.meta_path if type(f).__module__.startswith(celery_emq.__name__)]


def test_the_paths_the_docs_and_examples_name_import() -> None:
    from celery_emq.ops.flower import register
    from celery_emq.store import JobStore
    from celery_emq.store.status import queue_status
    from celery_emq.tasks import open_store
    from celery_emq.transport.jobs import JobInfo
    from celery_emq.transport.sweeper import Sweeper

    assert all(
        callable(x) for x in (register, JobInfo, queue_status, Sweeper, JobStore, open_store)
    )


def test_paths_stored_outside_the_code_keep_their_homes() -> None:
    """Result backends, users' include, signal receivers and kombu name these paths."""
    from kombu.utils.imports import symbol_by_name

    import celery_emq
    from celery_emq import errors, signals, tasks
    from celery_emq.transport.transport import Transport

    assert errors.StalledJobError.__module__ == "celery_emq.errors"
    assert tasks.sweep.name == "celery_emq.sweep"
    assert signals.job_dead_lettered.name == "job_dead_lettered"
    assert symbol_by_name("celery_emq.transport:Transport") is Transport
    assert celery_emq.StalledJobError is errors.StalledJobError


def test_lint_imports_keeps_the_layers() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_at_most_ten_modules_at_the_top_and_none_over_500_lines() -> None:
    package = ROOT / "celery_emq"
    top = [p for p in package.glob("*.py")]
    assert len(top) <= 10, sorted(p.name for p in top)
    long = {
        str(p.relative_to(package)): n
        for p in package.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_no_private_name_is_imported_across_a_layer() -> None:
    package = ROOT / "celery_emq"

    def layer(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else ""

    crossing = []
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_emq."):
                names = [a.name for a in node.names if a.name.startswith("_")]
                if names and layer(node.module or "") != layer(module):
                    crossing.append((module, node.module, names))
    assert not crossing, crossing
