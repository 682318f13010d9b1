"""How times and ages read and are read, the same in the CLI and on the morgue page."""

from __future__ import annotations

import re
from datetime import datetime, timezone

__all__ = ["age", "parse_time", "when"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def when(ms: int | None) -> str:
    """A time (ms since the epoch) in UTC, to the second; ``-`` for none."""
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def age(ms: int | None, sep: str = "") -> str:
    """A duration in ms as seconds, minutes or hours (``sep`` between number and unit)."""
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 120:
        return f"{s:.1f}{sep}s"
    if s < 7200:
        return f"{s / 60:.1f}{sep}{'min' if sep else 'm'}"
    return f"{s / 3600:.1f}{sep}h"


def parse_time(value: str) -> tuple[int, bool]:
    """Read a time: a duration ago (``90s``, ``30m``, ``2h``, ``7d``) or ISO-8601.

    Returns ``(ms, ago)``: a duration in ms to take from the Redis server's
    clock (``ago``), or a time in ms since the epoch (UTC when no offset is given).

    Raises:
        ValueError: neither form.
    """
    m = _DURATION.match(value.strip())
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)] * 1000), True
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("expected a duration ago (90s, 30m, 2h, 7d) or an ISO-8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return int(when.timestamp() * 1000), False
