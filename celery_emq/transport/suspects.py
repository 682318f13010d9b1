"""The suspect a process holds: at most one claim at a time that may kill it before it starts.

A suspect is a job whose lease lapsed before its task started: it may be a
message that kills the process receiving it. Should this process die before
it starts, the sweep blames it alone and forgives every other claim of its
queue, so a process holds one unstarted suspect at a time and claims every
other job beside it. This module keeps that one fact for the process's lease
keeper; ``Consuming._claim`` asks it before each claim.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Suspects"]

logger = logging.getLogger(__name__)


class Suspects:
    """The suspects a process holds whose task has not been heard to start.

    Args:
        live: whether a delivery tag still names a claim the process holds
            (not settled, not found lost); called without this object's lock
            held by its caller, never with the keeper's lock held here.
    """

    def __init__(self, live: Callable[[str], bool]) -> None:
        self._live = live
        self._lock = threading.Lock()
        # Each with the monotonic time it stops counting as one.
        self._until: dict[str, float] = {}
        # What to call once each of them is cleared (see hold).
        self._on_clear: dict[str, Callable[[], None]] = {}

    def hold(self, tag: str, for_s: float, on_clear: Callable[[], None] | None = None) -> None:
        """Note a held claim handed out as a suspect: this process takes no other for now.

        Until its task is heard to start (:meth:`started`), it is settled or
        released (:meth:`forget`), its lease is found lost, or ``for_s``
        seconds passed (a message that kills its receiver does so at once; one
        that waits, say for its ETA or a rate limit, must not hold back the
        next for long). ``on_clear`` is called (in the thread that heard of
        it) once it starts, is settled or released.
        """
        with self._lock:
            self._until[tag] = time.monotonic() + for_s
            if on_clear is not None:
                self._on_clear[tag] = on_clear

    def started(self, tag: str) -> None:
        """Note that a held claim's task started: it is no longer a suspect of this process."""
        self._tell(self._clear(tag))

    def forget(self, tag: str) -> None:
        """Note that a held claim was settled or released."""
        self._tell(self._clear(tag))

    def awaited(self) -> bool:
        """Whether a suspect this process holds has not started yet: take no other now."""
        with self._lock:
            held = list(self._until.items())
        now = time.monotonic()
        gone = [tag for tag, until in held if now >= until or not self._live(tag)]
        with self._lock:
            for tag in gone:
                self._until.pop(tag, None)
                self._on_clear.pop(tag, None)
            return bool(self._until)

    def hold_s(self) -> float:
        """How long, at most, the suspect this process holds counts as one (0: none)."""
        if not self.awaited():
            return 0.0
        with self._lock:
            until = min(self._until.values(), default=time.monotonic())
        return max(0.0, until - time.monotonic())

    def _clear(self, tag: str) -> Callable[[], None] | None:
        with self._lock:
            self._until.pop(tag, None)
            return self._on_clear.pop(tag, None)

    @staticmethod
    def _tell(on_clear: Callable[[], None] | None) -> None:
        if on_clear is not None:
            try:
                on_clear()
            except Exception:
                logger.debug("celery_emq: a suspect's clearing was not told", exc_info=True)
