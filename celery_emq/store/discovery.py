"""Asking the sentinels which server is the master, each at most its socket timeout.

redis-py's ``Sentinel.discover_master`` asks the sentinels one after another
and takes the first that names a master it believes: a hung sentinel listed
first costs its socket timeout (times its client's retries) on every connect,
and a sentinel left behind by a failover (it was cut off, or hung through it)
may name the old master first. :class:`BoundedSentinel` differs in two ways:

- Every sentinel that answers is heard, and among the masters they name (each
  checked as redis-py checks it: a master, not down, seen by
  ``min_other_sentinels`` others) the one with the newest ``config-epoch``
  wins: each failover increments the epoch, so the newest names the latest
  promotion. For :data:`FULL_ROUND_S` after such a full round, the process
  asks the sentinel whose answer won alone (a pool's watcher asks every
  second), and makes a full round again if it does not answer with a master
  it believes at that epoch or newer.
- A sentinel that failed to answer (timeout, refused) is remembered, for the
  whole process and every client that lists it, as not answering: later
  discoveries skip it rather than wait for it again, while a thread of its own
  asks it in the background until it answers (then it is heard again). It is
  asked in line only when no other sentinel answers at all. So a hung sentinel
  costs a discovery its socket timeout once, not once per reconnect.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from celery_emq.store.retries import connection_retry

__all__ = ["BoundedSentinel", "not_answering", "sentinel_kwargs"]

#: Sentinels (host, port) that last failed to answer -> when (monotonic).
_NOT_ANSWERING: dict[tuple[str, int], float] = {}
#: Sentinels a background thread is asking now -> the process it runs in (a
#: forked child has none of its parent's threads).
_PROBING: dict[tuple[str, int], int] = {}
#: (the sentinels listed, the master's name) -> when a full round was last
#: made, the index of the sentinel whose answer won it, and its epoch.
_WINNERS: dict[tuple[tuple[tuple[str, int], ...], str], tuple[float, int, int]] = {}
_LOCK = threading.Lock()

#: How long the sentinel whose answer won may be asked alone, before every
#: sentinel is asked again.
FULL_ROUND_S = 5.0


def sentinel_kwargs(
    params: dict[str, Any], timeout_s: float, user: dict[str, Any] | None
) -> dict[str, Any]:
    """How to connect to the sentinels: the transport's socket options, then the user's.

    Args:
        params: the connection parameters of the master's pool; its
            ``socket_*`` options apply to the sentinels too (as redis-py does
            when no ``sentinel_kwargs`` are given).
        timeout_s: the longest a sentinel may take to answer.
        user: the ``sentinel_kwargs`` transport option; each value given wins.
    """
    merged = {k: v for k, v in params.items() if k.startswith("socket_")}
    current = merged.get("socket_timeout")
    merged["socket_timeout"] = min(float(current), timeout_s) if current else timeout_s
    merged.update(connection_retry(0))
    merged.update(user or {})
    return merged


def not_answering() -> list[tuple[str, int]]:
    """The sentinels this process last found not answering (and not answering since)."""
    with _LOCK:
        return sorted(_NOT_ANSWERING)


def _address(client: Any) -> tuple[str, int]:
    kwargs = client.connection_pool.connection_kwargs
    return (str(kwargs.get("host")), int(kwargs.get("port") or 0))


class BoundedSentinel(Sentinel):
    """A ``redis.sentinel.Sentinel`` whose discovery hears every answering sentinel once."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        """The address of the master the answering sentinels name with the newest epoch.

        Raises:
            MasterNotFoundError: no sentinel names a master it believes.
        """
        key = (tuple(_address(c) for c in self.sentinels), service_name)
        named: list[tuple[int, int, tuple[str, int]]] = []
        with _LOCK:
            last = _WINNERS.get(key)
            if last is not None and _address(self.sentinels[last[1]]) in _NOT_ANSWERING:
                last = None
        if last is not None and time.monotonic() - last[0] < FULL_ROUND_S:
            # Within a full round's interval, the sentinel whose answer won
            # last is asked alone: its epoch may only have grown since.
            _at, order, epoch = last
            self._ask(self.sentinels[order], service_name, order, named, [])
            if named and named[0][0] >= epoch:
                return named[0][2]
            named.clear()
        errors: list[str] = []
        skipped = []
        heard = 0
        for order, client in enumerate(self.sentinels):
            with _LOCK:
                silent = _address(client) in _NOT_ANSWERING
            if silent:
                skipped.append((order, client))
                self._probe(client)
                continue
            heard += self._ask(client, service_name, order, named, errors)
        if not heard:
            # No other sentinel answers: those remembered silent are the last hope.
            for order, client in skipped:
                self._ask(client, service_name, order, named, errors)
        if not named:
            detail = f": {', '.join(errors)}" if errors else ""
            raise MasterNotFoundError(f"No master found for {service_name!r}{detail}")
        # The newest epoch wins; among equals, the sentinel listed first.
        epoch, order, address = max(named, key=lambda n: (n[0], -n[1]))
        with _LOCK:
            _WINNERS[key] = (time.monotonic(), order, epoch)
        return address

    def _ask(
        self,
        client: Any,
        service_name: str,
        order: int,
        named: list[tuple[int, int, tuple[str, int]]],
        errors: list[str],
    ) -> int:
        """Ask one sentinel; note the master it names; return 1 if it answered."""
        address = _address(client)
        try:
            masters = client.sentinel_masters()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with _LOCK:
                _NOT_ANSWERING.setdefault(address, time.monotonic())
            errors.append(f"{address[0]}:{address[1]} - {exc!r}")
            return 0
        with _LOCK:
            _NOT_ANSWERING.pop(address, None)
        state = masters.get(service_name)
        if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
            # redis-py 5.3 and later may be told to use another address (force_master_ip).
            forced = getattr(self, "_force_master_ip", None)
            ip = forced if forced is not None else state["ip"]
            named.append((int(state.get("config-epoch") or 0), order, (ip, int(state["port"]))))
        return 1

    def _probe(self, client: Any) -> None:
        """Ask a sentinel remembered silent from a thread of its own, one at a time."""
        address = _address(client)
        with _LOCK:
            if _PROBING.get(address) == os.getpid():
                return
            _PROBING[address] = os.getpid()

        def probe() -> None:
            try:
                client.sentinel_masters()
            except redis.RedisError:
                return
            finally:
                with _LOCK:
                    _PROBING.pop(address, None)
            with _LOCK:
                _NOT_ANSWERING.pop(address, None)
                # Heard again: the next discovery asks every sentinel.
                _WINNERS.clear()

        threading.Thread(target=probe, name="emq-sentinel-probe", daemon=True).start()
