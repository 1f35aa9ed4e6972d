"""What happens to an admitted incoming stream: chunks landing, completion, failure.

:class:`RxStreams` belongs to the ``lynx-rx-io`` thread
(:mod:`lynx_transport.ucx.receiver_loop`): it accounts each chunk whose bytes
are in place (verified against the sender's CRC32 when ``verify_chunks``),
completes regions, lanes and the stream (``LANE_DONE``, ``STREAM_DONE`` and the
callbacks), takes the sender's CHUNK_SUMs (kept for a stream not admitted yet
whose chunks are on their way), and fails a stream (its blocks, receives and token go to the
quarantine, ``STREAM_FAILED`` to the peer when asked). The loop owns the
connections; this class only writes frames on a stream's own one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lynx_transport.errors import ProtocolError, StreamCancelledError, TransportError
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.wire import (
    FrameType,
    pack_stream_lane,
    pack_stream_text,
    pack_u64,
    unpack_chunk_sum,
)
from lynx_transport.state import StreamState
from lynx_transport.stats import LaneCounters
from lynx_transport.ucx.receiver_quarantine import Quarantine
from lynx_transport.ucx.receiver_state import PostedChunk, RxPeer, RxStream

__all__ = ["RxStreams"]


class RxStreams:
    """``post(callback, *args)`` runs a callback on the callback thread; ``cb`` maps the
    receiver's callback names to them (or ``None``); ``completed`` and ``failed`` count
    the streams that ended so."""

    def __init__(self, pool: ReceivePool, clock: Clock, post: Callable[..., None],
                 cb: Mapping[str, Callable[..., Any] | None], quarantine: Quarantine,
                 counters: LaneCounters) -> None:
        self.pool, self.clock, self.post, self.cb = pool, clock, post, cb
        self.quarantine, self.counters = quarantine, counters
        self.completed = self.failed = 0

    def send(self, rx: RxStream, ftype: FrameType, payload: bytes) -> None:
        rx.conn.ctl.send(ftype, payload, self.clock.now())

    def finish_empty(self, rx: RxStream) -> None:
        """Regions and lanes with no bytes are complete as soon as the stream opens."""
        for i, r in enumerate(rx.handle.regions):
            if r.nbytes == 0:
                self.region_landed(rx, i)
        for lane in sorted(rx.lanes_open):
            if rx.lane_left[lane] == 0:
                self.lane_landed(rx, lane)
        if rx.left == 0:
            self.stream_landed(rx)

    def region_landed(self, rx: RxStream, i: int) -> None:
        region = rx.handle.regions[i]
        rx.handle._completion.region_done(region.name)
        self.post(self.cb["on_region"], rx.handle, region)

    def lane_landed(self, rx: RxStream, lane: int) -> None:
        rx.lanes_open.discard(lane)
        if rx.handle._completion.lane_done(lane, self.clock.now()):
            self.send(rx, FrameType.LANE_DONE, pack_stream_lane(rx.handle.stream_id, lane))
            self.post(self.cb["on_lane_complete"], rx.handle, lane)

    def stream_landed(self, rx: RxStream) -> None:
        if rx.handle._completion.finish(StreamState.COMPLETED, self.clock.now()):
            rx.handle._abandon = rx.handle._go = None
            self.completed += 1
            del rx.conn.streams[rx.handle.stream_id]
            rx.conn.completed_ids.append(rx.handle.stream_id)
            self.quarantine.free_token(rx.token)
            self.send(rx, FrameType.STREAM_DONE, pack_u64(rx.handle.stream_id))
            self.post(self.cb["on_stream_complete"], rx.handle)

    def abandon(self, rx: RxStream, reason: str) -> None:
        """The receiver's user gave the stream up (``ReceiveStream.abandon``)."""
        self.fail(rx, StreamCancelledError(f"stream {rx.handle.stream_id} was abandoned by the "
                                           f"receiver: {reason}"), StreamState.CANCELLED, tell_peer=True)

    def fail(self, rx: RxStream, exc: TransportError, state: StreamState,
             tell_peer: bool = False) -> None:
        h = rx.handle
        if not h._completion.finish(state, self.clock.now(), exc):
            return
        h._abandon = h._go = None
        self.failed += 1
        rx.conn.streams.pop(h.stream_id, None)
        requests = [(p.rail, p.request) for q in rx.pending.values() for p in q
                    if p.request is not None]
        for q in rx.pending.values():  # a stale frame (traceback) may still reference a queue
            q.regions.clear()
        rx.pending.clear()
        rx.unverified.clear()
        blocks = [(r.offset, r.nbytes) for r in h.regions] if h._mark_released() else []
        # the token stays taken too: no new stream's tags may match these receives
        self.quarantine.hold(self.clock.now(), blocks, requests, rx.token)
        if tell_peer and not rx.conn.ctl.closed:
            try:
                self.send(rx, FrameType.STREAM_FAILED, pack_stream_text(h.stream_id, 0, str(exc)))
            except TransportError:
                pass
        self.post(self.cb["on_stream_failed"], h, exc)

    def chunk_landed(self, rx: RxStream, p: PostedChunk, now: float) -> None:
        """Account one chunk whose bytes are in place (and verified, if asked)."""
        lane = p.lane
        self.counters.add(lane, p.nbytes, now)
        region = rx.handle.regions[p.region]
        on_chunk = self.cb["on_chunk"]
        if on_chunk is not None:
            self.post(on_chunk, rx.handle, region, p.offset, p.nbytes)
        rx.region_left[p.region] -= p.nbytes
        rx.lane_left[lane] -= p.nbytes
        rx.left -= p.nbytes
        if rx.region_left[p.region] == 0:
            self.region_landed(rx, p.region)
        if rx.lane_left[lane] == 0:
            self.lane_landed(rx, lane)
        if rx.left == 0:
            self.stream_landed(rx)

    def verify_chunk(self, rx: RxStream, p: PostedChunk) -> bool:
        """True when ``p``'s bytes match the sender's CHUNK_SUM; parks it until the sum arrives.

        A mismatch (a short, long or corrupted chunk) fails the stream.
        """
        try:
            return rx.verify(p, self.pool)
        except ProtocolError as exc:
            self.fail(rx, exc, StreamState.FAILED, tell_peer=True)
            return False

    def on_chunk_sum(self, conn: RxPeer, payload: bytes) -> None:
        sid, index, nbytes, crc = unpack_chunk_sum(payload)
        rx = conn.streams.get(sid)
        if rx is None:
            if sid in conn.completed_ids:
                raise ProtocolError(f"duplicate CHUNK_SUM for chunk {index} of stream {sid}, "
                                    "which already completed")
            if sid in conn.sent:  # its chunks came before admission: kept until then
                conn.early_sums.setdefault(sid, []).append((index, nbytes, crc))
            return  # the stream already failed or was cancelled: a late sum is harmless
        self.add_sum(rx, index, nbytes, crc)

    def add_sum(self, rx: RxStream, index: int, nbytes: int, crc: int) -> None:
        try:
            p = rx.add_sum(index, nbytes, crc)
        except ProtocolError as exc:
            self.fail(rx, exc, StreamState.FAILED, tell_peer=True)
            return
        if p is not None and self.verify_chunk(rx, p):
            self.chunk_landed(rx, p, self.clock.now())
