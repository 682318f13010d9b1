"""``celery emq dead`` time filters count back from the Redis server's clock."""

from __future__ import annotations

import time

import pytest

from celery_emq.ops import cli_dead as cli
from celery_emq.store.jobstore import JobStore


def test_a_duration_ago_is_taken_from_the_server_clock(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = store.server_ms()
    # The host's clock runs an hour ahead: it must not move the cutoff.
    ahead = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: ahead)
    monkeypatch.setattr(time, "time_ns", lambda: int(ahead * 1e9))
    args = cli._filter_args(
        {
            "queue": None,
            "task": None,
            "task_id": None,
            "reason": None,
            "since": None,
            "until": "30m",
        }
    )
    until = cli._on_server_clock(args, store)["until_ms"]
    assert server - 1_800_000 <= until <= store.server_ms() - 1_800_000


def test_an_iso_time_is_taken_as_it_is(store: JobStore) -> None:
    args = cli._filter_args(
        {
            "queue": None,
            "task": None,
            "task_id": None,
            "reason": None,
            "since": "2026-01-02T03:04:05",
            "until": None,
        }
    )
    resolved = cli._on_server_clock(args, store)
    assert resolved["since_ms"] == 1_767_323_045_000
    assert resolved["until_ms"] is None
