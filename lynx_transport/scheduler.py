"""Strict-priority chunk scheduler with a bytes-in-flight bound (pure logic).

UCX has no per-request priority, so Lynx decides the order itself: the sender
cuts each region into chunks of ``chunk_bytes`` and asks the scheduler which
chunk goes next. The rules:

* strict priority by lane number (lane 0 = ``Lane.ANCHOR`` first); within a
  lane, first in first out (stream order, then region order, then offset);
* at most ``max_inflight_bytes`` handed to UCX and not yet completed (a single
  chunk may always go when nothing is in flight), so a high-priority chunk never
  waits behind more than that backlog;
* a chunk leaves only when the :class:`~lynx_transport.shaper.Shaper` allows it.
  A lane held back by its *own* rate does not block lower lanes (work
  conserving); the link rate holds back everything.

Not thread-safe: the transport's I/O thread owns it. Tests drive it with a
:class:`~lynx_transport.clock.VirtualClock`.
"""

from __future__ import annotations

import collections
import dataclasses

from lynx_transport.clock import Clock
from lynx_transport.lanes import MAX_LANES, check_lane
from lynx_transport.shaper import Shaper

__all__ = ["Chunk", "PriorityScheduler", "chunk_count"]


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Number of chunks a region of ``nbytes`` is cut into (0 for an empty region)."""
    return -(-nbytes // chunk_bytes)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece of a region: ``nbytes`` at ``offset`` of region ``region`` of stream ``stream_id``.

    ``index`` numbers the chunks of a stream in manifest order; sender and
    receiver derive the same numbering from the manifest and the chunk size.
    """

    stream_id: int
    region: int
    lane: int
    index: int
    offset: int
    nbytes: int


@dataclasses.dataclass
class _Cursor:
    stream_id: int
    region: int
    lane: int
    size: int
    first_index: int
    next_offset: int = 0


class PriorityScheduler:
    """Decides which chunk leaves next. See the module docstring for the rules."""

    def __init__(self, clock: Clock, *, chunk_bytes: int = 1 << 20,
                 max_inflight_bytes: int = 4 << 20, shaper: Shaper | None = None) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        self._clock = clock
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.shaper = shaper if shaper is not None else Shaper(clock)
        self._queues: list[collections.deque[_Cursor]] = [collections.deque() for _ in range(MAX_LANES)]
        self._queued = [0] * MAX_LANES
        self._inflight_lane = [0] * MAX_LANES
        self._sent = [0] * MAX_LANES
        self._inflight = 0

    # -- queue -------------------------------------------------------------
    def add_region(self, stream_id: int, region: int, lane: int, nbytes: int,
                   first_index: int) -> None:
        """Queue a region of ``nbytes`` on ``lane``; its chunks are numbered from ``first_index``."""
        lane = check_lane(lane)
        if nbytes < 0:
            raise ValueError(f"region size must be >= 0, got {nbytes}")
        if nbytes == 0:
            return
        self._queues[lane].append(_Cursor(stream_id, region, lane, nbytes, first_index))
        self._queued[lane] += nbytes

    def remove_stream(self, stream_id: int) -> int:
        """Drop every queued (not yet sent) chunk of a stream; returns the bytes dropped."""
        dropped = 0
        for lane, queue in enumerate(self._queues):
            keep = collections.deque()
            for cur in queue:
                if cur.stream_id == stream_id:
                    left = cur.size - cur.next_offset
                    dropped += left
                    self._queued[lane] -= left
                else:
                    keep.append(cur)
            self._queues[lane] = keep
        return dropped

    # -- decisions -----------------------------------------------------------
    def _head(self, lane: int) -> tuple[_Cursor, int] | None:
        queue = self._queues[lane]
        if not queue:
            return None
        cur = queue[0]
        return cur, min(self.chunk_bytes, cur.size - cur.next_offset)

    def _inflight_allows(self, nbytes: int) -> bool:
        return self._inflight == 0 or self._inflight + nbytes <= self.max_inflight_bytes

    def next_chunk(self) -> Chunk | None:
        """The chunk to send now (already accounted as in flight), or ``None``.

        ``None`` means: nothing queued, the in-flight bound is reached (call
        :meth:`complete`), or shaping holds everything back (see :meth:`wait_time`).
        """
        for lane in range(MAX_LANES):
            head = self._head(lane)
            if head is None:
                continue
            cur, nbytes = head
            if not self._inflight_allows(nbytes):
                return None
            if self.shaper.lane_delay(lane, nbytes) > 0:
                continue  # this lane is over its own rate: lower lanes may go
            if self.shaper.link_delay(nbytes) > 0:
                return None
            self.shaper.consume(lane, nbytes)
            chunk = Chunk(cur.stream_id, cur.region, lane,
                          cur.first_index + cur.next_offset // self.chunk_bytes,
                          cur.next_offset, nbytes)
            cur.next_offset += nbytes
            if cur.next_offset >= cur.size:
                self._queues[lane].popleft()
            self._queued[lane] -= nbytes
            self._inflight += nbytes
            self._inflight_lane[lane] += nbytes
            return chunk
        return None

    def wait_time(self) -> float | None:
        """Seconds until shaping lets the next chunk go; ``None`` when shaping is not what blocks.

        (``None``: the queue is empty, or the in-flight bound is reached.)
        """
        best: float | None = None
        for lane in range(MAX_LANES):
            head = self._head(lane)
            if head is None:
                continue
            if not self._inflight_allows(head[1]):
                return None
            delay = self.shaper.delay(lane, head[1])
            best = delay if best is None else min(best, delay)
        return best

    def complete(self, chunk: Chunk) -> None:
        """A chunk handed out by :meth:`next_chunk` has left (or been abandoned)."""
        self._inflight -= chunk.nbytes
        self._inflight_lane[chunk.lane] -= chunk.nbytes
        self._sent[chunk.lane] += chunk.nbytes

    # -- observability ---------------------------------------------------------
    @property
    def inflight_bytes(self) -> int:
        return self._inflight

    def queued_bytes(self, lane: int) -> int:
        """Bytes on ``lane`` not yet handed to UCX."""
        return self._queued[check_lane(lane)]

    def inflight_lane_bytes(self, lane: int) -> int:
        return self._inflight_lane[check_lane(lane)]

    def sent_bytes(self, lane: int) -> int:
        """Bytes on ``lane`` whose send completed."""
        return self._sent[check_lane(lane)]

    @property
    def idle(self) -> bool:
        """True when nothing is queued and nothing is in flight."""
        return self._inflight == 0 and not any(self._queued)
