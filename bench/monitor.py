"""Counting what clients send a Redis, by command, with ``MONITOR``.

A script call counts once (``EVALSHA`` named by script); the commands scripts
run (``[N lua]`` lines) are counted apart.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from typing import Any

import redis

from celery_emq.store.loader import SCRIPT_NAMES, script_source

#: sha1 of each shipped script -> its name, to name an ``EVALSHA`` in the breakdown.
SCRIPTS = {hashlib.sha1(script_source(name).encode()).hexdigest(): name for name in SCRIPT_NAMES}


def _name(command: str) -> str:
    parts = command.split(" ", 3)
    name = parts[0].upper()
    if name in ("EVALSHA", "EVALSHA_RO") and len(parts) > 1:
        return f"{name} {SCRIPTS.get(parts[1], parts[1][:8])}"
    return name


class Monitor(threading.Thread):
    """Counts, per command, what ``MONITOR`` shows while :attr:`counting` is set."""

    def __init__(self, client: redis.Redis, own: set[str]) -> None:
        super().__init__(daemon=True)
        # The client owns the connection pool: it must outlive the monitor.
        self._client = client
        self._monitor = client.monitor()
        self._monitor.__enter__()
        self.own = own
        self.counting = False
        self.sent: Counter[str] = Counter()
        self.inner: Counter[str] = Counter()
        self.errors: list[str] = []

    def run(self) -> None:
        while True:
            try:
                event: dict[str, Any] | None = self._monitor.next_command()
            except redis.TimeoutError:
                continue  # a quiet spell (an idle worker may send nothing for seconds)
            except (redis.ConnectionError, OSError):
                return  # closed
            except (AttributeError, ValueError) as exc:
                # A line redis-py's parser does not take (binary arguments).
                self.errors.append(repr(exc))
                if self.counting:
                    self.sent["(unparsed)"] += 1
                continue
            if not self.counting or event is None:
                continue
            if event["client_type"] == "lua":
                self.inner[_name(event["command"])] += 1
            elif f"{event['client_address']}:{event['client_port']}" not in self.own:
                self.sent[_name(event["command"])] += 1

    def close(self) -> None:
        self._monitor.connection.disconnect()
