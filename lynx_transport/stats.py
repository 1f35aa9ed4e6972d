"""Counters the transport exposes: per-lane bytes, achieved rates, queue depths."""

from __future__ import annotations

import dataclasses

__all__ = ["LaneStats", "TransportStats"]


@dataclasses.dataclass(frozen=True)
class LaneStats:
    """One lane, as seen by one side of the transport.

    ``bytes`` counts completed bytes (sent and finished on the sender, landed on
    the receiver). ``achieved_gbps`` is ``bytes`` over the time from the lane's
    first use (first chunk handed to UCX; on the receiver, first stream
    accepted) to its last completion, in decimal Gbit/s (0.0 before any data);
    it is a lifetime average, idle time included. ``queued_bytes`` waits for the scheduler (sender only);
    ``inflight_bytes`` is handed to UCX and not yet complete.
    """

    lane: int
    bytes: int
    chunks: int
    achieved_gbps: float
    queued_bytes: int
    inflight_bytes: int


@dataclasses.dataclass(frozen=True)
class TransportStats:
    """A snapshot of a sender connection or a receiver."""

    lanes: tuple[LaneStats, ...]
    active_streams: int
    completed_streams: int
    failed_streams: int

    def lane(self, lane: int) -> LaneStats:
        for s in self.lanes:
            if s.lane == lane:
                return s
        return LaneStats(lane, 0, 0, 0.0, 0, 0)


class LaneCounters:
    """Mutable counters behind :class:`LaneStats` (owned by the I/O thread)."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        self.chunks: dict[int, int] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def started(self, lane: int, now: float) -> None:
        self.first.setdefault(lane, now)

    def add(self, lane: int, nbytes: int, now: float) -> None:
        self.first.setdefault(lane, now)
        self.bytes[lane] = self.bytes.get(lane, 0) + nbytes
        self.chunks[lane] = self.chunks.get(lane, 0) + 1
        self.last[lane] = now

    def snapshot(self, queued: dict[int, int], inflight: dict[int, int]) -> tuple[LaneStats, ...]:
        lanes = sorted(set(self.bytes) | {k for k, v in queued.items() if v}
                       | {k for k, v in inflight.items() if v})
        out = []
        for lane in lanes:
            nbytes = self.bytes.get(lane, 0)
            span = self.last.get(lane, 0.0) - self.first.get(lane, 0.0)
            gbps = nbytes * 8 / span / 1e9 if nbytes and span > 0 else 0.0
            out.append(LaneStats(lane, nbytes, self.chunks.get(lane, 0), gbps,
                                 queued.get(lane, 0), inflight.get(lane, 0)))
        return tuple(out)
