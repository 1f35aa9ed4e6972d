"""What a receiver's frames do to the sender's streams, one handler per frame type.

Run on the sender's I/O thread by :meth:`SenderLoop.on_frame
<lynx_transport.ucx.sender_loop.SenderLoop.on_frame>`; a frame for a stream the
peer no longer has (cancelled or failed meanwhile) is ignored, one that cannot be
right (a lane the stream does not use, a duplicate LANE_DONE, an ACCEPT with
another token than both sides derived) is a :class:`ProtocolError`, which breaks
the connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from lynx_transport.errors import (
    ClosedError,
    ManifestError,
    PeerDisconnectedError,
    PoolExhaustedError,
    ProtocolError,
    StreamFailedError,
    TransportError,
)
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.shaper import Rate
from lynx_transport.protocol.wire import (
    Frame,
    FrameType,
    RejectReason,
    unpack_rate,
    unpack_stream_lane,
    unpack_stream_text,
    unpack_stream_token,
    unpack_u64,
)
from lynx_transport.state import StreamState
from lynx_transport.ucx.sender_state import Peer, TxStream

__all__ = ["on_frame"]

class SenderLoop(Protocol):
    """What the handlers use of :class:`~lynx_transport.ucx.sender_loop.SenderLoop`."""

    clock: Clock
    completed: int

    def queue_region(self, tx: TxStream, i: int) -> None: ...
    def release_lane(self, tx: TxStream, lane: int) -> None: ...
    def maybe_finish_cancel(self, tx: TxStream) -> None: ...
    def forget(self, tx: TxStream) -> None: ...
    def fail(self, tx: TxStream, exc: TransportError, state: StreamState) -> None: ...
    def break_peer(self, peer: Peer, exc: TransportError) -> None: ...


_REJECT_ERRORS: dict[RejectReason, Callable[[str], TransportError]] = {
    RejectReason.MANIFEST: ManifestError,
    RejectReason.POOL_EXHAUSTED: PoolExhaustedError,
    RejectReason.CLOSED: ClosedError,
}


def _accept(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    sid, token = unpack_stream_token(payload)
    tx = peer.streams.get(sid)
    if tx is None or tx.accepted:
        return  # cancelled meanwhile, or a duplicate
    tx.accepted = True
    tx.handle._completion.activate()
    if tx.sent:  # its chunks are on their way already, under the token both derived
        if token != tx.token:
            raise ProtocolError(f"ACCEPT for stream {sid} with token {token:#x}, "
                                f"not the connection's {tx.token:#x}")
        return
    tx.token = token
    for i in tx.supplied:  # within a lane: first supplied, first sent
        loop.queue_region(tx, i)


def _reject(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    sid, code, text = unpack_stream_text(payload)
    tx = peer.streams.get(sid)
    if tx is None:
        return
    try:
        cls = _REJECT_ERRORS[RejectReason(code)]
    except (ValueError, KeyError):
        cls = StreamFailedError
    loop.fail(tx, cls(f"receiver refused stream {sid}: {text}"), StreamState.FAILED)
    if tx.sent:  # the receiver drains its chunks until CANCEL says no more come
        tx.cancelling = True
        loop.maybe_finish_cancel(tx)


def _lane_done(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    sid, lane = unpack_stream_lane(payload)
    tx = peer.streams.get(sid)
    if tx is not None:
        if lane not in tx.handle.manifest.lanes:
            raise ProtocolError(f"LANE_DONE for lane {lane}, which stream {sid} does not use")
        if not tx.handle._completion.lane_done(lane, loop.clock.now()):
            raise ProtocolError(f"duplicate LANE_DONE for lane {lane} of stream {sid}")


def _lane_go(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    sid, lane = unpack_stream_lane(payload, "LANE_GO")
    tx = peer.streams.get(sid)
    if tx is not None:
        if lane not in tx.handle.manifest.lanes:
            raise ProtocolError(f"LANE_GO for lane {lane}, which stream {sid} does not use")
        loop.release_lane(tx, lane)


def _stream_done(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    tx = peer.streams.get(unpack_u64(payload, "STREAM_DONE"))
    if tx is not None and tx.handle._completion.finish(StreamState.COMPLETED, loop.clock.now()):
        peer.completed += 1
        loop.completed += 1
        loop.forget(tx)
        # every byte is at the receiver: stop holding the caller's buffers
        # (a failed stream keeps them until its UCX requests are dropped)
        tx.views = [None] * len(tx.views)


def _stream_failed(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    sid, _, text = unpack_stream_text(payload)
    tx = peer.streams.get(sid)
    if tx is not None:
        loop.fail(tx, StreamFailedError(f"receiver failed stream {sid}: {text}"), StreamState.FAILED)


def _rate(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    gbps, burst = unpack_rate(payload)  # the receiver's cap: for this peer only
    peer.shaper.set_peer_rate(Rate(gbps, burst) if gbps > 0 else None)


def _goodbye(loop: SenderLoop, peer: Peer, payload: bytes) -> None:
    loop.break_peer(peer, PeerDisconnectedError("the receiver closed the connection"))


_HANDLERS: dict[FrameType, Callable[[SenderLoop, Peer, bytes], None]] = {
    FrameType.ACCEPT: _accept, FrameType.REJECT: _reject, FrameType.LANE_DONE: _lane_done,
    FrameType.LANE_GO: _lane_go, FrameType.STREAM_DONE: _stream_done,
    FrameType.STREAM_FAILED: _stream_failed, FrameType.RATE: _rate,
    FrameType.HEARTBEAT: lambda loop, peer, payload: None, FrameType.GOODBYE: _goodbye,
}


def on_frame(loop: SenderLoop, peer: Peer, frame: Frame) -> None:
    """Act on one frame from ``peer``'s receiver; ``ProtocolError`` for one a receiver never sends."""
    handler = _HANDLERS.get(frame.type)
    if handler is None:
        raise ProtocolError(f"unexpected {frame.type.name} frame from a receiver")
    handler(loop, peer, frame.payload)
