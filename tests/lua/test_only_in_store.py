"""Lua is loaded and run only inside the store subpackage."""

from __future__ import annotations

import re
from pathlib import Path

import celery_emq

RUNS_LUA = re.compile(r"register_script|script_load|evalsha|\bEVAL(SHA)?\b|script_source")


def test_no_module_outside_the_store_loads_or_runs_lua() -> None:
    root = Path(celery_emq.__file__).parent
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] != "store"
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if RUNS_LUA.search(line)
    ]
    assert found == []
