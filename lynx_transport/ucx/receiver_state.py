"""I/O-thread state of a receiver: posted receives, incoming streams, control connections.

Owned by the ``lynx-rx-io`` thread (:mod:`lynx_transport.ucx.receiver_loop`); plain data.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from typing import Any

from lynx_transport.errors import ProtocolError
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.receive_stream import ReceiveStream
from lynx_transport.ucx.control import ControlSocket

__all__ = ["PostedChunk", "LaneQueue", "RxStream", "RxPeer", "COMPLETED_MEMORY"]

#: Completed stream ids remembered per connection (to recognise late duplicate confirmations).
COMPLETED_MEMORY = 256


@dataclasses.dataclass
class PostedChunk:
    """One chunk's tagged receive, posted into the pool: where it lands and on which rail."""

    request: Any
    region: int
    offset: int
    nbytes: int
    index: int  # the chunk's number in the stream (tag low bits)
    lane: int = 0
    rail: int = 0  # the UCX worker it is posted on (see ucx.receiver_rail)


class LaneQueue:
    """A lane's posted receives, one FIFO per region.

    The sender sends a region's chunks in order, but regions in the order they
    were *supplied* (not manifest order), so each iteration looks at the oldest
    receive of every region on the lane: O(regions), exact for any order.
    """

    def __init__(self) -> None:
        self.regions: dict[int, collections.deque[PostedChunk]] = {}
        self.live = 0

    def append(self, p: PostedChunk) -> None:
        self.regions.setdefault(p.region, collections.deque()).append(p)
        self.live += 1

    def __bool__(self) -> bool:
        return self.live > 0

    def __iter__(self):
        return (p for q in self.regions.values() for p in q)

    def pop_completed(self) -> list[PostedChunk]:
        done = []
        for region, q in list(self.regions.items()):
            while q and q[0].request.completed:
                done.append(q.popleft())
            if not q:
                del self.regions[region]
        self.live -= len(done)
        return done


class RxStream:
    """I/O-thread state of one incoming stream."""

    def __init__(self, handle: ReceiveStream, token: int, conn: RxPeer) -> None:
        self.handle = handle
        self.token = token
        self.conn = conn
        self.pending: dict[int, LaneQueue] = collections.defaultdict(LaneQueue)
        m = handle.manifest
        self.region_left = [r.nbytes for r in m.regions]
        self.lane_left: dict[int, int] = collections.defaultdict(int)
        for r in m.regions:
            self.lane_left[r.lane] += r.nbytes
        self.lanes_open = set(self.lane_left)
        self.left = m.total_bytes
        self.chunk_total = m.chunk_total
        # verify_chunks: CRC32s announced by the sender, and chunks landed before their CRC
        self.sums: dict[int, tuple[int, int]] = {}
        self.unverified: dict[int, PostedChunk] = {}
        self.verified: set[int] = set()

    def add_sum(self, index: int, nbytes: int, crc: int) -> PostedChunk | None:
        """Record a CHUNK_SUM; returns the chunk it belongs to if that landed first.

        ``ProtocolError`` for a chunk past the manifest or a repeated sum.
        """
        sid = self.handle.stream_id
        if index >= self.chunk_total:
            raise ProtocolError(f"stream {sid}: CHUNK_SUM for chunk {index}, but the "
                                f"manifest has {self.chunk_total} chunks")
        if index in self.sums or index in self.verified:
            raise ProtocolError(f"stream {sid}: duplicate CHUNK_SUM for chunk {index}")
        self.sums[index] = (nbytes, crc)
        return self.unverified.pop(index, None)

    def verify(self, p: PostedChunk, pool: ReceivePool) -> bool:
        """True when landed chunk ``p``'s bytes in ``pool`` match its CHUNK_SUM; False
        (``p`` parked) until the sum arrives; ``ProtocolError`` on a mismatch (a
        short, long or corrupted chunk)."""
        got = self.sums.pop(p.index, None)
        if got is None:
            self.unverified[p.index] = p
            return False
        nbytes, crc = got
        region = self.handle.regions[p.region]
        view = pool.view(region.offset + p.offset, p.nbytes)
        if nbytes != p.nbytes or zlib.crc32(view if pool.device is None else view.get()) != crc:
            raise ProtocolError(
                f"stream {self.handle.stream_id}: chunk {p.index} of region {region.name!r} does "
                f"not match the sender's checksum (announced {nbytes} bytes, expected "
                f"{p.nbytes}): short, long or corrupted chunk")
        self.verified.add(p.index)
        return True


class RxPeer:
    """A sender connected to this receiver: its control socket, handshake state and streams."""

    def __init__(self, ctl: ControlSocket, now: float) -> None:
        self.ctl = ctl
        self.accepted_at = now
        self.hello = False          # True once WELCOME went out (authenticated if required)
        self.challenge: tuple[bytes, bytes] | None = None  # (nonce_s, nonce_r) awaiting PROOF
        self.streams: dict[int, RxStream] = {}
        self.key = 0                # the connection key of its tokens (WELCOME; wire.stream_token)
        #: Streams announced with OPEN_SENT (their chunks are on their way) not yet admitted,
        #: and CHUNK_SUMs that came for them meanwhile.
        self.sent: set[int] = set()
        self.early_sums: dict[int, list[tuple[int, int, int]]] = {}
        #: Refused OPEN_SENT streams whose chunks are received into scratch memory until the
        #: sender's CANCEL says none is left: id -> (token, (rail, request) receives, scratch).
        self.draining: dict[int, tuple[int, list[tuple[int, Any]], Any]] = {}
        # ids of recently completed streams: a CHUNK_SUM for one is a duplicate
        self.completed_ids: collections.deque[int] = collections.deque(maxlen=COMPLETED_MEMORY)
