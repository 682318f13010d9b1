"""The single clock seam: every timestamp a script sees comes from here.

Tests move time by passing ``now_ms`` explicitly to the store; everything else
calls :func:`now_ms`.
"""

from __future__ import annotations

import time

__all__ = ["now_ms"]


def now_ms() -> int:
    """Return the wall-clock time in whole milliseconds since the epoch."""
    return time.time_ns() // 1_000_000
