"""How times and ages read, the same in the CLI and on the morgue page."""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = ["age", "when"]


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
