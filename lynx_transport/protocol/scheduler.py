"""Strict-priority chunk scheduler with a bytes-in-flight bound (pure logic).

UCX has no per-request priority, so Lynx decides the order itself: the sender
cuts each region into chunks of ``chunk_bytes`` and asks the scheduler which
chunk goes next. One scheduler serves a whole sending node (an
:class:`~lynx_transport.ucx.egress.Egress`): every stream of every connection
(*peer*) made through it. The rules:

* strict priority by lane number (lane 0 = ``Lane.ANCHOR`` first), across every
  stream and every peer: no chunk of a lane leaves while a chunk of a higher
  lane, for any peer, is ready (queued and allowed by shaping);
* within a lane, across streams, the :class:`LanePolicy` (``FIFO`` by default).
  Within one stream a lane's regions go in the order they were queued, each
  from its first byte to its last;
* at most ``max_inflight_bytes`` handed to UCX and not yet completed, for all
  peers together (a single chunk may always go when nothing is in flight): a
  ready chunk of the highest lane that does not fit waits for completions, and
  nothing else goes meanwhile, so a high-priority chunk never waits behind more
  than that backlog;
* a chunk leaves only when shaping allows it: the egress :class:`Shaper` (the
  ``shaper`` argument: the node's link and lane rates) and, when the stream's
  peer has one (:meth:`PriorityScheduler.add_peer`), the peer's own (a per-peer
  cap, the rate the receiver asked for, per-peer lane rates). A bucket in debt
  holds back only what it applies to, and the rest may go (work conserving):
  a lane over its own rate does not block lower lanes, a peer over its cap
  does not block other peers; the egress link rate holds back everything.

Ids: stream ids are the scheduler's keys and must be unique within one
scheduler (an egress numbers the streams of all its connections from one
counter); peer keys are any hashable values (``None``: no peer of its own).

Not thread-safe: the transport's I/O thread owns it. Tests drive it with a
:class:`~lynx_transport.protocol.clock.VirtualClock`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import itertools
from collections.abc import Callable, Hashable

from lynx_transport.lanes import MAX_LANES, check_lane
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.shaper import Shaper

__all__ = ["Chunk", "LanePolicy", "PriorityScheduler", "chunk_count"]

_NO_BYTES = (0,) * MAX_LANES


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Number of chunks a region of ``nbytes`` is cut into (0 for an empty region)."""
    return -(-nbytes // chunk_bytes)


class LanePolicy(enum.Enum):
    """Which stream's chunk goes next within one lane (``TransportConfig.lane_policy``).

    * ``FIFO``: by arrival - the region queued first is sent first, whole, then
      the next (whichever stream it belongs to). One big stream delays every
      stream queued after it on its lane.
    * ``SRF``: shortest remaining first - the stream with the fewest bytes left
      queued on the lane goes first (ties: arrival order). Minimises the mean
      completion time of a lane; a big stream waits while smaller ones keep coming.
    * ``DRR``: deficit round-robin - streams take turns; each turn a stream earns
      ``quantum_bytes`` (default one chunk) of credit and sends chunks while its
      credit covers them. Every stream on the lane gets an equal share of it.

    Strict lane priority and shaping apply on top of every policy.
    """

    FIFO = "fifo"
    SRF = "srf"
    DRR = "drr"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece of a region: ``nbytes`` at ``offset`` of region ``region`` of stream ``stream_id``.

    ``index`` numbers the chunks of a stream in manifest order; sender and
    receiver derive the same numbering from the manifest and the chunk size.
    ``peer`` is the key the stream's regions were queued with.
    """

    stream_id: int
    region: int
    lane: int
    index: int
    offset: int
    nbytes: int
    peer: Hashable = None


@dataclasses.dataclass
class _Cursor:
    region: int
    size: int
    first_index: int
    seq: int  # arrival order, across the whole scheduler
    next_offset: int = 0


class _Flow:
    """One stream's queued regions on one lane, in the order they were queued."""

    __slots__ = ("cursors", "deficit", "lane", "peer", "remaining", "stream_id", "topped")

    def __init__(self, stream_id: int, peer: Hashable, lane: int) -> None:
        self.stream_id = stream_id
        self.peer = peer
        self.lane = lane
        self.cursors: collections.deque[_Cursor] = collections.deque()
        self.remaining = 0       # bytes queued and not yet handed out
        self.deficit = 0         # DRR credit
        self.topped = False      # DRR: this turn's quantum was added


class PriorityScheduler:
    """Decides which chunk leaves next. See the module docstring for the rules."""

    def __init__(self, clock: Clock, *, chunk_bytes: int = 1 << 20,
                 max_inflight_bytes: int = 4 << 20, shaper: Shaper | None = None,
                 policy: LanePolicy = LanePolicy.FIFO, quantum_bytes: int | None = None) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {max_inflight_bytes}")
        if not isinstance(policy, LanePolicy):
            raise ValueError(f"policy must be a LanePolicy, got {policy!r}")
        quantum = chunk_bytes if quantum_bytes is None else quantum_bytes
        if quantum < chunk_bytes:
            raise ValueError(f"quantum_bytes must be >= chunk_bytes ({chunk_bytes}), got {quantum}")
        self._clock = clock
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.policy = policy
        self.quantum_bytes = quantum
        self.shaper = shaper if shaper is not None else Shaper(clock)
        self._pick: Callable[[collections.deque[_Flow], Callable[[_Flow], bool]], _Flow | None] = {
            LanePolicy.FIFO: _pick_fifo, LanePolicy.SRF: _pick_srf, LanePolicy.DRR: self._pick_drr,
        }[policy]
        self._lanes: list[collections.deque[_Flow]] = [collections.deque() for _ in range(MAX_LANES)]
        self._flows: dict[int, dict[int, _Flow]] = {}  # stream id -> lane -> flow
        self._peer_shapers: dict[Hashable, Shaper] = {}
        self._seq = itertools.count()
        self._queued = [0] * MAX_LANES
        self._inflight_lane = [0] * MAX_LANES
        self._sent = [0] * MAX_LANES
        self._inflight = 0
        self._peer_queued: dict[Hashable, list[int]] = {}
        self._peer_inflight: dict[Hashable, list[int]] = {}

    # -- peers ---------------------------------------------------------------
    def add_peer(self, peer: Hashable, shaper: Shaper | None = None) -> None:
        """Register ``peer`` with its own shaper (``None``: shaped by the egress only)."""
        if shaper is None:
            self._peer_shapers.pop(peer, None)
        else:
            self._peer_shapers[peer] = shaper

    def remove_peer(self, peer: Hashable) -> int:
        """Forget ``peer``: drop every queued chunk of its streams and its shaper.

        Returns the bytes dropped. Its chunks in flight stay accounted until
        :meth:`complete` is called for them.
        """
        self._peer_shapers.pop(peer, None)
        sids = [sid for sid, lanes in self._flows.items()
                if any(f.peer == peer for f in lanes.values())]
        dropped = sum(self.remove_stream(sid) for sid in sids)
        self._peer_queued.pop(peer, None)
        return dropped

    # -- queue -------------------------------------------------------------
    def add_region(self, stream_id: int, region: int, lane: int, nbytes: int,
                   first_index: int, *, peer: Hashable = None) -> None:
        """Queue a region of ``nbytes`` on ``lane``; its chunks are numbered from ``first_index``.

        ``peer``: the connection the stream belongs to (its shaper, if
        registered with :meth:`add_peer`, applies). A stream's regions all
        belong to one peer.
        """
        lane = check_lane(lane)
        if nbytes < 0:
            raise ValueError(f"region size must be >= 0, got {nbytes}")
        if nbytes == 0:
            return
        lanes = self._flows.get(stream_id, {})
        for other in lanes.values():
            if other.peer != peer:
                raise ValueError(f"stream {stream_id} is queued for peer {other.peer!r}, "
                                 f"not {peer!r}")
        self._flows[stream_id] = lanes
        flow = lanes.get(lane)
        if flow is None:
            flow = lanes[lane] = _Flow(stream_id, peer, lane)
            self._lanes[lane].append(flow)
        flow.cursors.append(_Cursor(region, nbytes, first_index, next(self._seq)))
        flow.remaining += nbytes
        self._queued[lane] += nbytes
        self._peer_queued.setdefault(peer, [0] * MAX_LANES)[lane] += nbytes

    def remove_stream(self, stream_id: int) -> int:
        """Drop every queued (not yet sent) chunk of a stream; returns the bytes dropped."""
        dropped = 0
        for flow in list(self._flows.get(stream_id, {}).values()):
            dropped += flow.remaining
            self._account_queued(flow, -flow.remaining)
            self._drop_flow(flow)
        return dropped

    def _account_queued(self, flow: _Flow, nbytes: int) -> None:
        self._queued[flow.lane] += nbytes
        per_peer = self._peer_queued.get(flow.peer)
        if per_peer is not None:
            per_peer[flow.lane] += nbytes

    def _drop_flow(self, flow: _Flow) -> None:
        queue = self._lanes[flow.lane]
        if queue and queue[0] is flow:
            queue.popleft()
        else:
            queue.remove(flow)
        lanes = self._flows[flow.stream_id]
        del lanes[flow.lane]
        if not lanes:
            del self._flows[flow.stream_id]

    # -- decisions -----------------------------------------------------------
    def _inflight_allows(self, nbytes: int) -> bool:
        return self._inflight == 0 or self._inflight + nbytes <= self.max_inflight_bytes

    def _head_bytes(self, flow: _Flow) -> int:
        cur = flow.cursors[0]
        return min(self.chunk_bytes, cur.size - cur.next_offset)

    def _peer_delay(self, peer: Hashable, lane: int) -> float:
        shaper = self._peer_shapers.get(peer)
        return shaper.delay(lane, 0) if shaper is not None else 0.0

    def next_chunk(self) -> Chunk | None:
        """The chunk to send now (already accounted as in flight), or ``None``.

        ``None`` means: nothing queued, the in-flight bound is reached (call
        :meth:`complete`), or shaping holds everything back (see :meth:`wait_time`).
        """
        if self.shaper.link_delay(0) > 0:
            return None  # the egress link holds back every lane of every peer
        for lane in range(MAX_LANES):
            flows = self._lanes[lane]
            if not flows or self.shaper.lane_delay(lane, 0) > 0:
                continue  # empty, or this lane is over its own rate: lower lanes may go
            ready: dict[Hashable, bool] = {}

            def is_ready(flow: _Flow, lane: int = lane, ready: dict[Hashable, bool] = ready) -> bool:
                ok = ready.get(flow.peer)
                if ok is None:
                    ok = ready[flow.peer] = self._peer_delay(flow.peer, lane) <= 0
                return ok

            flow = self._pick(flows, is_ready)
            if flow is None:
                continue  # every stream here is held by its peer's shaping: lower lanes may go
            nbytes = self._head_bytes(flow)
            if not self._inflight_allows(nbytes):
                return None  # the highest ready chunk waits for room; nothing overtakes it
            return self._take(flow, nbytes)
        return None

    def _take(self, flow: _Flow, nbytes: int) -> Chunk:
        lane = flow.lane
        cur = flow.cursors[0]
        self.shaper.consume(lane, nbytes)
        peer_shaper = self._peer_shapers.get(flow.peer)
        if peer_shaper is not None:
            peer_shaper.consume(lane, nbytes)
        chunk = Chunk(flow.stream_id, cur.region, lane,
                      cur.first_index + cur.next_offset // self.chunk_bytes,
                      cur.next_offset, nbytes, flow.peer)
        cur.next_offset += nbytes
        if cur.next_offset >= cur.size:
            flow.cursors.popleft()
        flow.remaining -= nbytes
        if self.policy is LanePolicy.DRR:
            flow.deficit -= nbytes
        self._account_queued(flow, -nbytes)
        if not flow.cursors:
            self._drop_flow(flow)
        self._inflight += nbytes
        self._inflight_lane[lane] += nbytes
        self._peer_inflight.setdefault(flow.peer, [0] * MAX_LANES)[lane] += nbytes
        return chunk

    def _pick_drr(self, ring: collections.deque[_Flow],
                  ready: Callable[[_Flow], bool]) -> _Flow | None:
        """Deficit round-robin: the head of the ring sends while its credit lasts."""
        for _ in range(2 * len(ring)):
            flow = ring[0]
            if ready(flow):
                if flow.deficit >= self._head_bytes(flow):
                    return flow
                if not flow.topped:  # a new turn: earn a quantum (>= one chunk)
                    flow.deficit += self.quantum_bytes
                    flow.topped = True
                    return flow
            # turn over: credit spent, or held back by its peer's shaping
            flow.topped = False
            ring.rotate(-1)
        return None

    def wait_time(self) -> float | None:
        """Seconds until the next chunk may go: ``0.0`` when one may go now, the shaping
        delay when shaping holds back every queued chunk, ``None`` when shaping is not
        what blocks (the queue is empty, or the in-flight bound holds the next chunk:
        wait for :meth:`complete`).

        A chunk that :meth:`next_chunk` refused a moment ago may be ready by the time
        this is asked (the bucket refilled in between): that is ``0.0``, never ``None``,
        so a sender that sleeps until the returned deadline, or until a completion when
        given ``None``, never sleeps past a ready chunk with nothing in flight.
        """
        best: float | None = None
        link = self.shaper.link_delay(0)
        for lane in range(MAX_LANES):
            flows = self._lanes[lane]
            if not flows:
                continue
            lane_delay = max(link, self.shaper.lane_delay(lane, 0))
            ready: dict[int, _Flow] = {}
            for flow in flows:
                delay = max(lane_delay, self._peer_delay(flow.peer, lane))
                if delay <= 0:
                    ready[id(flow)] = flow
                else:
                    best = delay if best is None else min(best, delay)
            if ready:
                # strict priority: this lane's chunk goes next, when it fits in flight (the
                # chunk next_chunk() would pick; DRR's pick turns its ring, so not asked here)
                if self.policy is LanePolicy.DRR:
                    head = min(self._head_bytes(flow) for flow in ready.values())
                else:
                    picked = self._pick(flows, functools.partial(_among, ready))
                    assert picked is not None
                    head = self._head_bytes(picked)
                return 0.0 if self._inflight_allows(head) else None
        return best

    def complete(self, chunk: Chunk) -> None:
        """A chunk handed out by :meth:`next_chunk` has left (or been abandoned)."""
        self._inflight -= chunk.nbytes
        self._inflight_lane[chunk.lane] -= chunk.nbytes
        self._sent[chunk.lane] += chunk.nbytes
        per_peer = self._peer_inflight.get(chunk.peer)
        if per_peer is not None:
            per_peer[chunk.lane] -= chunk.nbytes
            if not any(per_peer) and chunk.peer not in self._peer_queued:
                del self._peer_inflight[chunk.peer]  # a removed peer's last chunk

    # -- observability ---------------------------------------------------------
    @property
    def inflight_bytes(self) -> int:
        return self._inflight

    def queued_bytes(self, lane: int) -> int:
        """Bytes on ``lane`` not yet handed to UCX."""
        return self._queued[check_lane(lane)]

    def inflight_lane_bytes(self, lane: int) -> int:
        """Bytes on ``lane`` handed to UCX and not yet completed."""
        return self._inflight_lane[check_lane(lane)]

    def peer_queued_bytes(self, peer: Hashable, lane: int) -> int:
        """:meth:`queued_bytes` of ``peer``'s streams only."""
        return self._peer_queued.get(peer, _NO_BYTES)[check_lane(lane)]

    def peer_inflight_bytes(self, peer: Hashable, lane: int) -> int:
        """:meth:`inflight_lane_bytes` of ``peer``'s streams only."""
        return self._peer_inflight.get(peer, _NO_BYTES)[check_lane(lane)]

    def sent_bytes(self, lane: int) -> int:
        """Bytes on ``lane`` whose send completed."""
        return self._sent[check_lane(lane)]

    def peers(self) -> set[Hashable]:
        """Peers with a shaper, queued bytes or chunks in flight (what the scheduler still holds)."""
        return (set(self._peer_shapers) | {p for p, q in self._peer_queued.items() if any(q)}
                | {p for p, q in self._peer_inflight.items() if any(q)})

    @property
    def idle(self) -> bool:
        """True when nothing is queued and nothing is in flight."""
        return self._inflight == 0 and not any(self._queued)


def _among(flows: dict[int, _Flow], flow: _Flow) -> bool:
    return id(flow) in flows


def _pick_fifo(flows: collections.deque[_Flow], ready: Callable[[_Flow], bool]) -> _Flow | None:
    """The ready stream whose next region was queued first."""
    best: _Flow | None = None
    for flow in flows:
        if (best is None or flow.cursors[0].seq < best.cursors[0].seq) and ready(flow):
            best = flow
    return best


def _pick_srf(flows: collections.deque[_Flow], ready: Callable[[_Flow], bool]) -> _Flow | None:
    """The ready stream with the fewest bytes left queued on the lane (ties: arrival)."""
    best: _Flow | None = None
    for flow in flows:
        if (best is None or (flow.remaining, flow.cursors[0].seq)
                < (best.remaining, best.cursors[0].seq)) and ready(flow):
            best = flow
    return best
