"""Clocks: the one source of time for the scheduler, the shaper and timeouts.

Pure logic takes a :class:`Clock` so tests can drive it with :class:`VirtualClock`
(which only moves when told to) instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "VirtualClock"]


class Clock(Protocol):
    """Anything with a ``now()`` in seconds that never goes backwards."""

    def now(self) -> float: ...


class MonotonicClock:
    """Real time: :func:`time.monotonic`."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """A clock that only moves when :meth:`advance` or :meth:`set` is called."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds})")
        self._now += seconds
        return self._now

    def set(self, when: float) -> None:
        """Jump to ``when`` (not earlier than now)."""
        if when < self._now:
            raise ValueError(f"a clock cannot go backwards ({when} < {self._now})")
        self._now = float(when)
