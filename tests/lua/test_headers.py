"""Each script's header lists exactly the KEYS and ARGV its Python wrapper sends."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from celery_emq.store.keys import QueueKeys
from celery_emq.store.loader import SCRIPT_NAMES, script_source
from celery_emq.store.outcomes import NewJob
from celery_emq.store.scripts import Scripts

HEADER = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)(\.\.)?\]", re.M)
KEY_LINE = re.compile(r"^\s*KEYS\[(\d+)\]\s+\w+\s+<p>:(\S+)", re.M)
NOW_LINE = re.compile(r"^\s*ARGV\[(\d+)\]\s+now_ms\b", re.M)


def header(name: str) -> str:
    return script_source(name).split("]]", 1)[0]


def header_arity(name: str) -> tuple[int, int, bool]:
    """Return (keys, argv, argv_is_variadic) declared in a script's header."""
    keys = argv = 0
    variadic = False
    for kind, index, dots in HEADER.findall(header(name)):
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
        recorder = self

        class Run:
            sha = source

            def __call__(self, keys: list[Any], args: list[Any], client: Any) -> Any:
                recorder.calls.append((keys, args))
                return reply(source)

        return Run()

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        """The direct call :meth:`Scripts.run` makes (``sha`` is the source here)."""
        self.calls.append((list(keys_and_args[:numkeys]), list(keys_and_args[numkeys:])))
        return reply(sha)


def reply(source: str) -> Any:
    """An empty answer of the script whose source is given, in the shape its wrapper reads."""
    first = source.split("\n", 1)[0]
    return [None, None] if "oldest" in first else []


Call = Callable[[Scripts, QueueKeys], Any]
PAIRS = [("a", 1), ("b", 2)]
JOBS = [NewJob("a", b"{}"), NewJob("b", b"{}", 3, None, "g", 5, "t")]

#: One call per script, and how many ARGV items it sends past the fixed ones.
CALLS: dict[str, tuple[Call, int]] = {
    "enqueue": (lambda s, k: s.enqueue(k, "id", b"{}", 0, 1), 0),
    "enqueue_many": (lambda s, k: s.enqueue_many(k, JOBS, 1, 10), 14),
    "claim": (lambda s, k: s.claim(k, 1, 1000, "w", 1), 0),
    "start": (lambda s, k: s.start(k, "id", 1), 0),
    "ack": (lambda s, k: s.ack(k, PAIRS), 4),
    "release": (lambda s, k: s.release(k, "id", 1), 0),
    "extend": (lambda s, k: s.extend(k, 1000, 1, PAIRS), 4),
    "bury": (lambda s, k: s.bury(k, "id", 1, "r", "e", 1), 0),
    "purge": (lambda s, k: s.purge(k, 10, True, ["completed", "failed"]), 2),
    "reap": (lambda s, k: s.reap(k, 1, 10), 0),
    "sweep": (
        lambda s, k: s.sweep(k, 1, 10, 1, "worker_lost", 5000, PAIRS, expiring="emq:expiring"),
        4,
    ),
    "retry": (lambda s, k: s.retry(k, 1, ["a", "b"]), 2),
    "purge_dead": (lambda s, k: s.purge_dead(k, ["a", "b"]), 2),
    "retire": (lambda s, k: s.retire(k, "id", True, 1), 0),
    "give_back": (lambda s, k: s.give_back(k), 0),
    "budget": (lambda s, k: s.budget(k, "id", 3), 0),
    "promote": (lambda s, k: s.promote(k, 1, 10, ["t1", "t2"]), 2),
    "tally": (lambda s, k: s.tally(k, 0, 10, True), 0),
    "oldest": (lambda s, k: s.oldest(k, 0, 10, 0, 10), 0),
    "look": (lambda s, k: s.look([k], ["5"], 1, 1000, 0, 0, "emq:expiring"), 1),
}

#: Calls that leave the time to the Redis server (``now_ms=None``).
SERVER_TIME: dict[str, Call] = {
    "enqueue": lambda s, k: s.enqueue(k, "id", b"{}", 0, None),
    "enqueue_many": lambda s, k: s.enqueue_many(k, JOBS, None),
    "claim": lambda s, k: s.claim(k, None, 1000, "w", 1),
    "extend": lambda s, k: s.extend(k, 1000, None, PAIRS),
    "bury": lambda s, k: s.bury(k, "id", 1, "r", "e", None),
    "reap": lambda s, k: s.reap(k, None, 10),
    "sweep": lambda s, k: s.sweep(k, None, 10, 1, "lease_expired", 5000),
    "retry": lambda s, k: s.retry(k, None, ["a"]),
    "retire": lambda s, k: s.retire(k, "id", False, None),
    "promote": lambda s, k: s.promote(k, None, 10),
    "look": lambda s, k: s.look([k], ["5"], None, 1000, 0, 0, "emq:expiring"),
}


def record(call: Call) -> tuple[list[Any], list[Any]]:
    rec = Recorder()
    scripts = Scripts(rec)
    try:
        call(scripts, QueueKeys("emq", "q"))
    except Exception:
        pass  # the recorder's reply does not fit every wrapper; the call was recorded
    [(keys, args)] = rec.calls
    return keys, args


def test_every_script_has_a_call_here() -> None:
    assert set(CALLS) == set(SCRIPT_NAMES)


def test_every_script_that_reads_a_time_has_a_server_time_call_here() -> None:
    assert set(SERVER_TIME) == {n for n in SCRIPT_NAMES if NOW_LINE.search(header(n))}


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_matches_wrapper(name: str) -> None:
    call, extra = CALLS[name]
    keys, args = record(call)
    n_keys, n_argv, variadic = header_arity(name)
    assert len(keys) == n_keys
    if variadic:
        # ARGV[n..] starts the variable part: n - 1 fixed items before it.
        assert len(args) == n_argv - 1 + extra
    else:
        assert (len(args), extra) == (n_argv, 0)
    # The one exception: the x-expires registry of the sweep (optional) and of the
    # look, which the store names only on one server (JobStore.one_server).
    shared = [key for key in keys if not (name in ("sweep", "look") and key == "emq:expiring")]
    assert all("{q}" in key for key in shared), "every key shares the queue hash tag"


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_names_each_key_in_the_order_sent(name: str) -> None:
    keys, _ = record(CALLS[name][0])
    declared = {
        int(i): "emq:" + path.replace("<id>", "id") for i, path in KEY_LINE.findall(header(name))
    }
    assert sorted(declared) == list(range(1, len(keys) + 1))
    assert [declared[i + 1] for i in range(len(keys))] == keys


@pytest.mark.parametrize("name", sorted(SERVER_TIME))
def test_no_time_given_sends_an_empty_now_ms(name: str) -> None:
    _, args = record(SERVER_TIME[name])
    [index] = NOW_LINE.findall(header(name))
    assert args[int(index) - 1] == ""


def test_pairs_are_sent_id_then_token() -> None:
    for name in ("ack", "extend", "sweep"):
        call, extra = CALLS[name]
        _, args = record(call)
        assert args[-extra:] == ["a", 1, "b", 2], name


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_binds_names_before_use(name: str) -> None:
    body = script_source(name).split("]]", 1)[1]
    # Below the prologue no bare KEYS[n] / ARGV[n] appears (loops over ARGV excepted).
    lines = [ln for ln in body.splitlines() if re.search(r"(KEYS|ARGV)\[\d", ln)]
    prologue = [ln for ln in lines if ln.startswith("local ")]
    assert lines == prologue
