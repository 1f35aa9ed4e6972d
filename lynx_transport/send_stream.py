"""The sender's handle on one outgoing stream: a future completed by the receiver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lynx_transport.errors import TransportError
from lynx_transport.protocol.manifest import Manifest
from lynx_transport.state import Completion, StreamState

__all__ = ["SendStream"]


class SendStream:
    """An outgoing stream. Completes only when the receiver confirms every byte landed.

    ``wait_lane(lane, timeout)`` returns once the receiver confirmed that lane;
    ``wait(timeout)`` once it confirmed the whole stream. Both raise the
    stream's error if it failed (e.g. ``PeerDisconnectedError``,
    ``PoolExhaustedError``, ``ManifestError`` from the receiver) or was
    cancelled (``StreamCancelledError``), and ``TransportTimeoutError`` when the
    timeout passes first.
    """

    def __init__(self, manifest: Manifest, opened_at: float,
                 call: Callable[[Callable[[], Any], float], Any]) -> None:
        self.manifest = manifest
        self.opened_at = opened_at
        self._completion = Completion(f"stream {manifest.stream_id}")
        #: Monotonic time the first chunk was handed to UCX (``None`` before).
        self.started_at: float | None = None
        self._call = call
        self._names = {r.name: i for i, r in enumerate(manifest.regions)}
        # set by the connection's I/O thread
        self._supply: Callable[[int, Any], None] | None = None
        self._cancel: Callable[[], None] | None = None
        self._release_lane: Callable[[int], None] | None = None

    def __repr__(self) -> str:
        return f"SendStream(id={self.stream_id}, state={self.state.value})"

    @property
    def stream_id(self) -> int:
        return self.manifest.stream_id

    @property
    def state(self) -> StreamState:
        return self._completion.state

    def done(self) -> bool:
        return self.state.terminal

    def exception(self) -> TransportError | None:
        return self._completion.error

    def wait(self, timeout: float) -> None:
        """Block until the receiver confirmed the whole stream."""
        self._completion.wait(timeout)

    def wait_lane(self, lane: int, timeout: float) -> None:
        """Block until the receiver confirmed every region on ``lane``."""
        self._completion.wait_lane(int(lane), timeout)

    def wait_released(self, lane: int, timeout: float) -> None:
        """Block until a lane held since the stream opened (``hold=``) is released,
        by the receiver or :meth:`release_lane`; returns at once for a lane not
        held. Raises like :meth:`wait` (the stream's error, or
        ``TransportTimeoutError``); a stream that ends otherwise before the
        release raises ``TransportError``. A sender can encode a held lane's
        bytes only once they are wanted."""
        self._completion.wait_released(int(lane), timeout)

    @property
    def lane_released_at(self) -> dict[int, float]:
        """Monotonic time each held lane was released (see ``Connection.open_stream``)."""
        return dict(self._completion.lane_released_at)

    @property
    def completed_at(self) -> float | None:
        """Monotonic time the confirmation (or the failure) arrived."""
        return self._completion.completed_at

    @property
    def lane_completed_at(self) -> dict[int, float]:
        return dict(self._completion.lane_completed_at)

    def supply(self, name: str, buffer: Any, timeout: float = 5.0) -> None:
        """Provide the bytes of region ``name`` (for streams opened with ``open_stream``).

        Regions are scheduled as they are supplied: on one lane, the first
        supplied is sent first. The buffer must stay alive and unchanged until
        the stream is done.
        """
        if name not in self._names:
            raise KeyError(f"stream {self.stream_id} has no region {name!r}")
        index = self._names[name]
        assert self._supply is not None
        supply = self._supply
        self._call(lambda: supply(index, buffer), timeout)

    def release_lane(self, lane: int, timeout: float = 5.0) -> None:
        """Start sending a lane held since the stream opened (the receiver can
        release it too). Idempotent; a no-op on a finished stream."""
        assert self._release_lane is not None
        release, lane = self._release_lane, int(lane)
        self._call(lambda: release(lane), timeout)

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop sending; the stream ends cancelled once chunks already handed to UCX finish.

        No-op on a finished stream. Returns when the cancel was requested; use
        ``wait`` to see the final state.
        """
        assert self._cancel is not None
        self._call(self._cancel, timeout)
