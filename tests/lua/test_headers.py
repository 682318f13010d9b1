"""Each script's header lists exactly the KEYS and ARGV its Python wrapper sends."""

from __future__ import annotations

import re
from typing import Any

import pytest

from celery_emq.keys import QueueKeys
from celery_emq.scripts import SCRIPT_NAMES, Scripts, script_source

HEADER = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)(\.\.)?\]", re.M)


def header_arity(name: str) -> tuple[int, int, bool]:
    """Return (keys, argv, argv_is_variadic) declared in a script's header."""
    header = script_source(name).split("]]", 1)[0]
    keys = argv = 0
    variadic = False
    for kind, index, dots in HEADER.findall(header):
        if kind == "KEYS":
            keys = max(keys, int(index))
        else:
            argv = max(argv, int(index))
            variadic = variadic or bool(dots)
    return keys, argv, variadic


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[Any], list[Any]]] = []

    def register_script(self, source: str) -> Any:
        def run(keys: list[Any], args: list[Any], client: Any) -> Any:
            self.calls.append((keys, args))
            return 0 if "trim" in source.split("\n", 1)[0] else []

        return run


CALLS = {
    "enqueue": lambda s, k: s.enqueue(k, "id", b"{}", 0, 1),
    "claim": lambda s, k: s.claim(k, 1, 1000, "w", 1),
    "ack": lambda s, k: s.ack(k, "id", "w"),
    "release": lambda s, k: s.release(k, "id", "w"),
    "extend": lambda s, k: s.extend(k, "w", 1, ["a", "b"]),
    "bury": lambda s, k: s.bury(k, "id", "r", "e", 1),
    "purge": lambda s, k: s.purge(k, 10),
    "reap": lambda s, k: s.reap(k, 1, 10),
    "sweep": lambda s, k: s.sweep(k, 1, 10, 1, "lease_expired", "w", ["a", "b"]),
    "trim": lambda s, k: s.trim(k, 1, 1000, 10, 10),
    "retry": lambda s, k: s.retry(k, 1, ["a", "b"]),
    "purge_dead": lambda s, k: s.purge_dead(k, ["a", "b"]),
}


def test_every_script_has_a_call_here() -> None:
    assert set(CALLS) == set(SCRIPT_NAMES)


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_matches_wrapper(name: str) -> None:
    rec = Recorder()
    scripts = Scripts(rec)
    try:
        CALLS[name](scripts, QueueKeys("emq", "q"))
    except Exception:
        pass  # the recorder's reply does not fit every wrapper; the call was recorded
    [(keys, args)] = rec.calls
    n_keys, n_argv, variadic = header_arity(name)
    assert len(keys) == n_keys
    if variadic:
        assert len(args) >= n_argv
    else:
        assert len(args) == n_argv
    assert all("{q}" in key for key in keys), "every key shares the queue hash tag"


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_binds_names_before_use(name: str) -> None:
    body = script_source(name).split("]]", 1)[1]
    # Below the prologue no bare KEYS[n] / ARGV[n] appears (loops over ARGV excepted).
    lines = [ln for ln in body.splitlines() if re.search(r"(KEYS|ARGV)\[\d", ln)]
    prologue = [ln for ln in lines if ln.startswith("local ")]
    assert lines == prologue
