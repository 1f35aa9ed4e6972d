"""Stream states and the thread-safe completion record behind every stream handle.

Every stream ends in exactly one terminal state: ``COMPLETED``, ``FAILED`` or
``CANCELLED``. The I/O thread records progress; any thread may wait on it with
a timeout. Waiting past the timeout raises
:class:`~lynx_transport.errors.TransportTimeoutError`; waiting on a stream that
ended failed or cancelled raises the stream's error (for a lost peer that is
:class:`~lynx_transport.errors.PeerDisconnectedError`; for a cancelled stream
:class:`~lynx_transport.errors.StreamCancelledError`).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable

from lynx_transport.errors import TransportError, TransportTimeoutError

__all__ = ["StreamState", "Completion"]


class StreamState(enum.Enum):
    OPENING = "opening"      # manifest sent / received, not yet accepted
    ACTIVE = "active"        # data moving
    COMPLETED = "completed"  # every byte in place, confirmed by the receiver
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (StreamState.COMPLETED, StreamState.FAILED, StreamState.CANCELLED)


class Completion:
    """Lanes, regions and the stream's terminal state, with blocking waits."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._cond = threading.Condition()
        self._state = StreamState.OPENING
        self._error: TransportError | None = None
        self._lanes: set[int] = set()
        self._regions: set[str] = set()
        self.completed_at: float | None = None
        self.lane_completed_at: dict[int, float] = {}
        self._held: set[int] = set()
        self.lane_released_at: dict[int, float] = {}

    @property
    def state(self) -> StreamState:
        return self._state

    @property
    def error(self) -> TransportError | None:
        return self._error

    # -- I/O thread -----------------------------------------------------------------
    def activate(self) -> None:
        with self._cond:
            if self._state is StreamState.OPENING:
                self._state = StreamState.ACTIVE

    def region_done(self, name: str) -> None:
        with self._cond:
            self._regions.add(name)
            self._cond.notify_all()

    def lane_done(self, lane: int, now: float) -> bool:
        """Record a lane; False if it was already recorded (exactly once)."""
        with self._cond:
            if lane in self._lanes:
                return False
            self._lanes.add(lane)
            self.lane_completed_at[lane] = now
            self._cond.notify_all()
            return True

    def hold(self, lanes: Iterable[int]) -> None:
        """Lanes held until released (set when the stream opens)."""
        with self._cond:
            self._held.update(lanes)

    def lane_released(self, lane: int, now: float) -> bool:
        """Release a held lane; False (and no change) if it is not held."""
        with self._cond:
            if lane not in self._held:
                return False
            self._held.discard(lane)
            self.lane_released_at[lane] = now
            self._cond.notify_all()
            return True

    def finish(self, state: StreamState, now: float, error: TransportError | None = None) -> bool:
        """Enter a terminal state; False (and no change) if one was already reached."""
        with self._cond:
            if self._state.terminal:
                return False
            self._state = state
            self._error = _detached(error)
            self.completed_at = now
            self._cond.notify_all()
            return True

    # -- any thread ---------------------------------------------------------------------
    def _wait(self, ready, timeout: float, what: str) -> None:
        if timeout is None or timeout < 0:
            raise ValueError("every wait needs a timeout in seconds (>= 0)")
        with self._cond:
            ok = self._cond.wait_for(lambda: ready() or self._state.terminal, timeout)
            if ready():
                return
            if self._state.terminal and self._error is not None:
                raise self._error
            if not ok:
                raise TransportTimeoutError(f"{self._what}: {what} not done after {timeout} s")
            raise TransportError(f"{self._what} ended {self._state.value} before {what}")

    def wait_region(self, name: str, timeout: float) -> None:
        self._wait(lambda: name in self._regions, timeout, f"region {name!r}")

    def wait_lane(self, lane: int, timeout: float) -> None:
        self._wait(lambda: lane in self._lanes, timeout, f"lane {lane}")

    def wait(self, timeout: float) -> None:
        self._wait(lambda: self._state is StreamState.COMPLETED, timeout, "the stream")

    def wait_released(self, lane: int, timeout: float) -> None:
        self._wait(lambda: lane not in self._held, timeout, f"the release of lane {lane}")

    def is_held(self, lane: int) -> bool:
        with self._cond:
            return lane in self._held

    def region_is_done(self, name: str) -> bool:
        with self._cond:
            return name in self._regions

    def lane_is_done(self, lane: int) -> bool:
        with self._cond:
            return lane in self._lanes


def _detached(error: TransportError | None) -> TransportError | None:
    """``error`` (and its cause/context chain) without traceback frames.

    A stored error outlives the I/O thread; the frames of a traceback would pin
    whatever they referenced (UCX requests, hence the UCX worker and its file
    descriptors) for as long as the user holds the stream.
    """
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error
