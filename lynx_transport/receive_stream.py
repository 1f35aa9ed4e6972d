"""The receiver's handle on one incoming stream."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from lynx_transport.errors import TransportError
from lynx_transport.protocol.manifest import Manifest
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.state import Completion, StreamState

__all__ = ["ReceivedRegion", "ReceiveStream"]


@dataclasses.dataclass(frozen=True)
class ReceivedRegion:
    """Where a region of the manifest lives in the pool."""

    name: str
    lane: int
    nbytes: int
    offset: int


class ReceiveStream:
    """An incoming stream: its manifest, its regions in the pool, and its progress.

    Created by the receiver's I/O thread when a manifest is accepted (before any
    data arrives) and handed to ``on_stream_open`` / ``Receiver.next_stream``.
    ``view(name)`` is a ``uint8`` view into the pool (NumPy or CuPy, no copy);
    its bytes are final once ``wait_region(name, ...)`` returned or
    ``on_region`` fired. A completed stream keeps its pool memory until
    :meth:`release`; a failed or cancelled one is released by the transport.
    """

    def __init__(self, manifest: Manifest, regions: tuple[ReceivedRegion, ...], pool: ReceivePool,
                 peer: str, release_cb: Callable[[ReceiveStream], None]) -> None:
        self.manifest = manifest
        self.regions = regions
        self.peer = peer
        self._pool = pool
        self._by_name = {r.name: r for r in regions}
        self._completion = Completion(f"stream {manifest.stream_id} from {peer}")
        self._release_cb = release_cb
        self._released = False
        self._lock = threading.Lock()
        # set by the I/O thread while the stream is live
        self._abandon: Callable[[str, float], None] | None = None
        self._go: Callable[[int, float], None] | None = None

    def __repr__(self) -> str:
        return (f"ReceiveStream(id={self.stream_id}, regions={len(self.regions)}, "
                f"bytes={self.manifest.total_bytes}, state={self.state.value})")

    @property
    def stream_id(self) -> int:
        return self.manifest.stream_id

    @property
    def metadata(self) -> bytes:
        """The sender's opaque metadata blob (e.g. a KV layout descriptor)."""
        return self.manifest.metadata

    @property
    def state(self) -> StreamState:
        return self._completion.state

    def exception(self) -> TransportError | None:
        """Why the stream failed or was cancelled (``None`` otherwise)."""
        return self._completion.error

    def region(self, name: str) -> ReceivedRegion:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"stream {self.stream_id} has no region {name!r}") from None

    def view(self, name: str) -> Any:
        """The region's bytes as a ``uint8`` NumPy/CuPy view into the pool (no copy)."""
        with self._lock:
            if self._released:
                raise TransportError(f"stream {self.stream_id} was released; its views are gone")
        r = self.region(name)
        return self._pool.view(r.offset, r.nbytes)

    def region_done(self, name: str) -> bool:
        return self._completion.region_is_done(name)

    def wait_region(self, name: str, timeout: float) -> Any:
        """Block until region ``name`` is in place; return its view."""
        self.region(name)
        self._completion.wait_region(name, timeout)
        return self.view(name)

    def wait_lane(self, lane: int, timeout: float) -> None:
        """Block until every region on ``lane`` is in place."""
        self._completion.wait_lane(int(lane), timeout)

    def wait(self, timeout: float) -> None:
        """Block until the stream completed; raise its error if it failed or was cancelled."""
        self._completion.wait(timeout)

    @property
    def completed_at(self) -> float | None:
        """Monotonic time the stream reached its terminal state."""
        return self._completion.completed_at

    @property
    def lane_completed_at(self) -> dict[int, float]:
        return dict(self._completion.lane_completed_at)

    def release_lane(self, lane: int, timeout: float = 5.0) -> None:
        """Tell the sender to start sending ``lane``, if it holds it (see
        ``Connection.open_stream(hold=...)``): a receiver that is busy with the
        bytes already here (the first model step on the anchors, say) holds the
        lower lanes until it is ready for them.

        Returns once the request is on its way. Idempotent; a no-op on a
        finished stream or for a lane whose bytes all landed. ``ValueError``
        for a lane the stream does not use.
        """
        lane = int(lane)
        if lane not in self.manifest.lanes:
            raise ValueError(f"stream {self.stream_id} has no lane {lane} "
                             f"(its lanes: {list(self.manifest.lanes)})")
        go = self._go
        if self.state.terminal or go is None or lane in self._completion.lane_completed_at:
            return
        go(lane, timeout)

    def abandon(self, reason: str, timeout: float = 5.0) -> None:
        """Give up on a stream that has not completed (a residual that never arrives, say).

        The stream ends CANCELLED (``StreamCancelledError`` carrying ``reason``),
        never completed; the sender is told (its stream fails), the stream's
        receives are cancelled and its pool memory is released by the
        transport after the quarantine - so copy out what you keep (the
        anchor) first: views become invalid. A no-op on a finished stream.
        """
        if self.state.terminal or self._abandon is None:
            return
        self._abandon(reason, timeout)

    def release(self) -> None:
        """Give the stream's regions back to the pool (views become invalid). Idempotent.

        Only a finished stream can be released; failed and cancelled streams are
        released by the transport itself.
        """
        if not self.state.terminal:
            raise TransportError(f"stream {self.stream_id} is still {self.state.value}; "
                                 "wait for it before releasing")
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release_cb(self)

    def _mark_released(self) -> bool:
        with self._lock:
            was = self._released
            self._released = True
            return not was

    def __enter__(self) -> ReceiveStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state.terminal:
            self.release()
