"""Sentinel discovery: the newest config-epoch wins; a silent sentinel costs its timeout once.

The sentinels here are stand-ins answering ``SENTINEL MASTERS`` as redis-py
parses it (no Lua runs); ``tests/topology/test_sentinel.py`` and
``tests/faults/test_failover_sentinel.py`` run the same discovery against real
sentinels, one of them hung.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import redis
from redis.sentinel import MasterNotFoundError

from celery_emq.store import discovery
from celery_emq.store.discovery import BoundedSentinel, not_answering

NAME = "m"
_ports = itertools.count(61000)


class StandIn:
    """Answers ``sentinel_masters()`` with a master at ``port`` and ``epoch``, or fails."""

    def __init__(
        self, port: int | None, epoch: int = 0, fails: bool = False, hang_s: float = 0.0
    ) -> None:
        self.address = ("10.0.0.1", next(_ports))
        self.connection_pool = type("Pool", (), {})()
        self.connection_pool.connection_kwargs = {"host": self.address[0], "port": self.address[1]}
        self.port, self.epoch, self.fails, self.hang_s = port, epoch, fails, hang_s
        self.asked = 0
        self.lock = threading.Lock()

    def sentinel_masters(self) -> dict[str, Any]:
        with self.lock:
            self.asked += 1
        if self.fails:
            # A hung sentinel: the socket timeout runs out.
            time.sleep(self.hang_s)
            raise redis.TimeoutError("Timeout reading from socket")
        if self.port is None:
            return {}
        return {
            NAME: {
                "ip": "127.0.0.1",
                "port": self.port,
                "config-epoch": self.epoch,
                "is_master": True,
                "is_sdown": False,
                "is_odown": False,
                "num-other-sentinels": 2,
            }
        }


def sentinel(*stand_ins: StandIn) -> BoundedSentinel:
    s = BoundedSentinel([])
    s.sentinels = list(stand_ins)
    return s


@pytest.mark.usefixtures("every_round_full")
def test_the_master_named_with_the_newest_epoch_wins_wherever_listed() -> None:
    # The first sentinel missed the failover (epoch 3 names the old master).
    stale, fresh, also = StandIn(7000, epoch=3), StandIn(7001, epoch=4), StandIn(7001, epoch=4)
    assert sentinel(stale, fresh, also).discover_master(NAME) == ("127.0.0.1", 7001)
    assert sentinel(fresh, stale).discover_master(NAME) == ("127.0.0.1", 7001)
    assert (stale.asked, fresh.asked, also.asked) == (2, 2, 1)


@pytest.fixture
def every_round_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "FULL_ROUND_S", 0.0)


def test_between_full_rounds_the_winner_is_asked_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "FULL_ROUND_S", 0.3)
    stale, fresh = StandIn(7000, epoch=3), StandIn(7001, epoch=4)
    for _ in range(5):
        assert sentinel(stale, fresh).discover_master(NAME) == ("127.0.0.1", 7001)
    assert (stale.asked, fresh.asked) == (1, 5)
    time.sleep(0.3)
    assert sentinel(stale, fresh).discover_master(NAME) == ("127.0.0.1", 7001)
    assert (stale.asked, fresh.asked) == (2, 6)
    # The winner names no master now: every sentinel is asked.
    fresh.port = None
    stale.epoch = 5
    assert sentinel(stale, fresh).discover_master(NAME) == ("127.0.0.1", 7000)


@pytest.mark.usefixtures("every_round_full")
def test_a_hung_sentinel_costs_its_timeout_once_then_is_probed_aside() -> None:
    hung, good = StandIn(7000, fails=True, hang_s=0.5), StandIn(7001, epoch=1)
    first = sentinel(hung, good)
    t0 = time.monotonic()
    assert first.discover_master(NAME) == ("127.0.0.1", 7001)
    assert time.monotonic() - t0 >= 0.5
    assert hung.asked == 1
    assert hung.address in not_answering()
    # Another client listing the same sentinels (a reconnect) does not wait
    # on it: only a background probe asks it, one at a time.
    again = sentinel(hung, good)
    t0 = time.monotonic()
    for _ in range(5):
        assert again.discover_master(NAME) == ("127.0.0.1", 7001)
    assert time.monotonic() - t0 < 0.25
    deadline = time.monotonic() + 5
    while hung.asked < 2:
        assert time.monotonic() < deadline, "no probe asked it"
        time.sleep(0.01)
    assert hung.asked == 2  # one probe, still waiting, for five discoveries
    assert good.asked == 6
    # Once it answers (to a probe) it is heard in line again.
    hung.fails = False
    hung.epoch = 9
    deadline = time.monotonic() + 5
    while hung.address in not_answering():
        assert time.monotonic() < deadline, "the probe never found it answering"
        again.discover_master(NAME)
        time.sleep(0.05)
    assert again.discover_master(NAME) == ("127.0.0.1", 7000)


@pytest.mark.usefixtures("every_round_full")
def test_sentinels_remembered_silent_are_asked_in_line_when_no_other_answers() -> None:
    silent, down = StandIn(7000, fails=True), StandIn(7001, fails=True)
    s = sentinel(silent, down)
    with pytest.raises(MasterNotFoundError, match="No master found for 'm'"):
        s.discover_master(NAME)
    assert (silent.asked, down.asked) == (1, 1)
    silent.fails = False
    # Both are remembered silent; no other answers: they are asked in line.
    assert s.discover_master(NAME) == ("127.0.0.1", 7000)
    assert silent.address not in not_answering()


def test_a_master_its_sentinel_deems_down_is_not_named() -> None:
    down, up = StandIn(7000, epoch=5), StandIn(7001, epoch=4)
    original = down.sentinel_masters

    def sdown() -> dict[str, Any]:
        masters = original()
        masters[NAME]["is_sdown"] = True
        return masters

    down.sentinel_masters = sdown  # type: ignore[method-assign]
    assert sentinel(down, up).discover_master(NAME) == ("127.0.0.1", 7001)
