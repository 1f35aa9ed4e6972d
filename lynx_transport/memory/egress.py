"""The sending side of the in-memory twin: :class:`MemoryEgress` and :class:`MemorySender`.

As the UCX transport's :class:`~lynx_transport.ucx.egress.Egress`: an egress has ONE
:class:`~lynx_transport.protocol.scheduler.PriorityScheduler` and ONE egress
:class:`~lynx_transport.protocol.shaper.Shaper` for every connection made through it, so
lane priority holds across all its peers (listeners) and within a lane
``TransportConfig.lane_policy`` orders the streams; each connection keeps a
shaper of its own (its cap, ``MemorySender.set_link_rate``), registered with the
scheduler as its peer; stream ids come from one counter per egress; a broken
connection fails only its own streams and leaves :meth:`MemoryEgress.peers`.
``MemoryTransport.connect`` gives a connection a private egress, closed with it
(unshaped itself; the connection's shaper starts from the config's rates).

Threads: the network's one thread (:mod:`lynx_transport.memory.loop`) owns an
egress's state (:class:`EgressCore`, :class:`EgressPeer`, :class:`StreamEnds`); the public
methods hand it work and wait at most their timeout for the hand-off. Each round
the thread asks each egress's scheduler for one chunk and copies it into the
listener's pool at once, so nothing is ever in flight between rounds.

Dependencies point one way: :mod:`lynx_transport.memory.transport` (the network and the
listeners) imports this module, never the reverse. What the sending side needs of a
listener is a :class:`ListenerHooks` (the frames a sender sends, as callables the
listener hands over), and of the network a :class:`NetworkHooks`; both are built by
:mod:`lynx_transport.memory.transport`, whose listeners in turn call the public methods of
:class:`EgressCore`.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lynx_transport.config import TransportConfig
from lynx_transport.errors import (
    ClosedError,
    PeerDisconnectedError,
    StreamCancelledError,
    TransportError,
)
from lynx_transport.lanes import check_lane
from lynx_transport.memory.loop import CLOCK
from lynx_transport.protocol.manifest import Manifest, RegionSpec, encode_manifest
from lynx_transport.protocol.scheduler import Chunk, PriorityScheduler
from lynx_transport.protocol.shaper import Rate, Shaper
from lynx_transport.protocol.views import as_bytes_view
from lynx_transport.receive_stream import ReceiveStream
from lynx_transport.send_stream import SendStream
from lynx_transport.state import StreamState

if TYPE_CHECKING:
    from lynx_transport.seam import EgressLike, Sender

__all__ = ["EgressPeer", "EgressCore", "ListenerHooks", "MemoryEgress", "MemorySender", "NetworkHooks",
           "StreamEnds"]

_CONN_KEYS = itertools.count(1)  # scheduler peer keys and peer names, unique in the process


@dataclass(frozen=True)
class ListenerHooks:
    """What the sending side calls on the listener a connection goes to, on the network
    thread: the frames a sender would send, one callable each (``MemoryListener`` builds it)."""

    address: tuple[str, int]
    #: A connection arrives (``ConnectError`` once the listener is closed) / leaves.
    attach: Callable[[EgressPeer], None]
    detach: Callable[[EgressPeer], None]
    #: The OPEN frame: the manifest's bytes.
    accept: Callable[[StreamEnds, bytes], None]
    #: One chunk the scheduler picked, copied into the pool at once (``now``: the round's time).
    deliver: Callable[[StreamEnds, Chunk, float], None]
    #: The receiving end fails (a CANCEL frame, or the connection ends); False if it was done.
    fail_rx: Callable[[StreamEnds, TransportError, StreamState], bool]
    #: The stream is over on the sending side: no longer wait for pool space for it.
    unwait: Callable[[StreamEnds], None]


@dataclass(frozen=True)
class NetworkHooks:
    """What an egress needs of its network (``MemoryTransport`` builds it)."""

    #: Join the network's round (any thread); returns the network thread's ``run(fn, timeout)``.
    add_egress: Callable[[EgressCore], Callable[[Callable[[], Any], float], Any]]
    #: Leave it: every connection is closed (any thread, waits at most ``timeout``).
    remove_egress: Callable[[EgressCore, float], None]
    #: The listener at an address, on the network thread (``ConnectError`` if nobody listens).
    find: Callable[[tuple[str, int]], ListenerHooks]


class EgressPeer:
    """One connection: a peer of an egress, to one listener; its own shaper and streams."""

    def __init__(self, egress: EgressCore, listener: ListenerHooks, shaper: Shaper) -> None:
        self.key = next(_CONN_KEYS)
        self.peer = f"memory-sender-{self.key}"  # what the listener's streams call it
        self.egress, self.listener, self.shaper = egress, listener, shaper
        self.address = listener.address
        self.streams: dict[int, StreamEnds] = {}
        self.broken: TransportError | None = None


class StreamEnds:
    """Both ends of one stream: the sender's handle and buffers, the receiver's handle and counts."""

    def __init__(self, conn: EgressPeer, tx: SendStream, views: list[Any | None]) -> None:
        self.conn, self.tx, self.views = conn, tx, views
        self.supplied = [i for i, v in enumerate(views) if v is not None]  # in supply order
        self.accepted = self.cancelling = False
        self.rx: ReceiveStream | None = None
        self.region_left: list[int] = []
        self.lane_left: dict[int, int] = collections.defaultdict(int)
        self.left = 0


class EgressCore:
    """What the network thread keeps of one egress: the scheduler and shaper its
    connections share, and the connections (live ones, oldest first)."""

    def __init__(self, config: TransportConfig, link: Rate | None, lanes: dict[int, Rate]) -> None:
        self.shaper = Shaper(CLOCK, link, lanes)
        self.sched = PriorityScheduler(CLOCK, chunk_bytes=config.chunk_bytes,
                                       max_inflight_bytes=config.max_inflight_bytes,
                                       shaper=self.shaper, policy=config.lane_policy)
        #: Stream ids for every connection of this egress (``next`` is atomic: any thread).
        self.ids = itertools.count(1)
        self.conns: dict[int, EgressPeer] = {}
        self.closed = False

    def attach(self, listener: ListenerHooks, shaper: Shaper) -> EgressPeer:
        if self.closed:
            raise ClosedError("the egress is closed")
        conn = EgressPeer(self, listener, shaper)
        listener.attach(conn)  # ConnectError once the listener is closed
        self.conns[conn.key] = conn
        self.sched.add_peer(conn.key, shaper)
        return conn

    # -- the sender's side of a stream ---------------------------------------------------------
    def open(self, conn: EgressPeer, handle: SendStream, payload: bytes, views: list[Any | None]) -> None:
        if conn.broken is not None:
            raise conn.broken
        s = StreamEnds(conn, handle, views)
        handle._supply = lambda i, buf: self.supply(s, i, buf)
        handle._cancel = lambda: self.cancel(s)
        handle._release_lane = lambda lane: self.release(s, lane)
        conn.streams[handle.stream_id] = s
        conn.listener.accept(s, payload)  # the OPEN frame

    def supply(self, s: StreamEnds, i: int, buffer: Any) -> None:
        if s.tx.state.terminal:
            raise s.tx.exception() or ClosedError(f"stream {s.tx.stream_id} is finished")
        spec = s.tx.manifest.regions[i]
        if s.views[i] is not None:
            raise ValueError(f"region {spec.name!r} was already supplied")
        view = as_bytes_view(buffer)
        if view.nbytes != spec.nbytes:
            raise ValueError(f"region {spec.name!r} is {spec.nbytes} bytes in the manifest, "
                             f"the buffer has {view.nbytes}")
        s.views[i] = view
        s.supplied.append(i)
        if s.accepted:
            self.queue(s, i)

    def queue(self, s: StreamEnds, i: int) -> None:
        spec = s.tx.manifest.regions[i]
        if not s.tx._completion.is_held(spec.lane):  # else queued by release
            self.sched.add_region(s.tx.stream_id, i, spec.lane, spec.nbytes,
                                  s.tx.manifest.first_chunk_indices()[i], peer=s.conn.key)

    def release(self, s: StreamEnds, lane: int) -> None:
        if s.tx.state.terminal or s.cancelling or not s.tx._completion.lane_released(lane, CLOCK.now()):
            return
        for i in s.supplied if s.accepted else ():
            if s.tx.manifest.regions[i].lane == lane:
                self.queue(s, i)

    def cancel(self, s: StreamEnds) -> None:
        if s.tx.state.terminal or s.cancelling:
            return
        s.cancelling = True
        sid = s.tx.stream_id
        self.fail_tx(s, StreamCancelledError(f"stream {sid} was cancelled"), StreamState.CANCELLED)
        s.conn.listener.fail_rx(s, StreamCancelledError(f"stream {sid} was cancelled by its sender"),
                                StreamState.CANCELLED)  # the CANCEL frame

    def forget(self, s: StreamEnds) -> None:
        s.conn.streams.pop(s.tx.stream_id, None)
        self.sched.remove_stream(s.tx.stream_id)
        s.conn.listener.unwait(s)
        s.views = [None] * len(s.views)  # stop holding the caller's buffers

    def fail_tx(self, s: StreamEnds, exc: TransportError, state: StreamState = StreamState.FAILED) -> None:
        s.tx._completion.finish(state, CLOCK.now(), exc)
        self.forget(s)

    # -- the network thread's round ---------------------------------------------------------------
    def step(self, now: float) -> tuple[bool, float | None]:
        """Move the one chunk the scheduler picks (if any); else when shaping lets one go."""
        chunk = self.sched.next_chunk()
        if chunk is None:
            wait = self.sched.wait_time()
            return False, None if wait is None else now + wait
        self.sched.complete(chunk)  # copied below, at once: never in flight past this round
        assert isinstance(chunk.peer, int)  # queued with a connection's key
        conn = self.conns.get(chunk.peer)
        s = conn.streams.get(chunk.stream_id) if conn is not None else None
        if s is not None:
            s.conn.listener.deliver(s, chunk, now)
        return True, None

    # -- endings ---------------------------------------------------------------------------------
    def drop(self, conn: EgressPeer, rx_exc: TransportError, tx_exc: TransportError) -> None:
        """The connection ends: receiving ends fail with ``rx_exc``, sending ends with ``tx_exc``;
        it leaves the egress (peers, scheduler) and the listener."""
        if conn.broken is not None:
            return
        conn.broken = tx_exc
        for s in list(conn.streams.values()):
            conn.listener.fail_rx(s, rx_exc, StreamState.FAILED)
            self.fail_tx(s, tx_exc)
        self.conns.pop(conn.key, None)
        self.sched.remove_peer(conn.key)
        conn.listener.detach(conn)

    def close(self) -> None:
        self.closed = True
        for conn in list(self.conns.values()):
            self.drop(conn, PeerDisconnectedError(f"peer {conn.peer} closed the connection"),
                      ClosedError("the connection was closed"))


class MemorySender:
    """The sending side (:class:`lynx_transport.seam.Sender`); from ``MemoryTransport.connect``
    or :meth:`MemoryEgress.connect`."""

    def __init__(self, egress: MemoryEgress, conn: EgressPeer) -> None:
        self.config = egress.config
        self._egress, self._conn = egress, conn
        self._run = egress._loop_run
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of the listener."""
        return self._conn.address

    @property
    def broken(self) -> TransportError | None:
        return self._conn.broken

    def _call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        if self._closed:
            raise ClosedError("the connection is closed")
        return self._run(fn, timeout)

    def open_stream(self, regions: Sequence[RegionSpec | tuple[str, int, int]],
                    metadata: bytes = b"", timeout: float = 5.0,
                    hold: Iterable[int] = ()) -> SendStream:
        specs = tuple(r if isinstance(r, RegionSpec) else RegionSpec(r[0], r[1], r[2]) for r in regions)
        return self._open(specs, [None] * len(specs), metadata, timeout, hold)

    def send_stream(self, regions: Sequence[tuple[str, Any, int]], metadata: bytes = b"",
                    timeout: float = 5.0, hold: Iterable[int] = ()) -> SendStream:
        views: list[Any | None] = []
        specs = []
        for item in regions:
            if len(item) != 3:
                raise ValueError(f"regions are (name, buffer, lane) tuples, got {item!r}")
            name, buffer, lane = item
            views.append(view := as_bytes_view(buffer))
            specs.append(RegionSpec(name, int(view.nbytes), lane))
        return self._open(tuple(specs), views, metadata, timeout, hold)

    def _open(self, specs: tuple[RegionSpec, ...], views: list[Any | None], metadata: bytes,
              timeout: float, hold: Iterable[int]) -> SendStream:
        core = self._conn.egress
        manifest = Manifest(next(core.ids), self.config.chunk_bytes, specs, bytes(metadata))
        payload = encode_manifest(manifest, self.config.manifest_limits)
        held = frozenset(check_lane(lane) for lane in hold)
        if not held <= set(manifest.lanes):
            raise ValueError(f"cannot hold lanes {sorted(held - set(manifest.lanes))}: no region "
                             "travels on them")
        handle = SendStream(manifest, CLOCK.now(), self._run)
        handle._completion.hold(held)
        self._call(lambda: core.open(self._conn, handle, payload, views), timeout)
        return handle

    def set_link_rate(self, rate: Rate | None) -> None:
        """This connection's cap; on a shared egress the egress's rate holds on top of it."""
        self._call(lambda: self._conn.shaper.set_link_rate(rate))

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._egress._private:
            self._egress.close(timeout)
            return
        conn = self._conn
        self._run(lambda: conn.egress.drop(
            conn, PeerDisconnectedError(f"peer {conn.peer} closed the connection"),
            ClosedError("the connection was closed")), timeout)

    def __enter__(self) -> MemorySender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryEgress:
    """A sending node's egress (:class:`lynx_transport.seam.EgressLike`); from
    ``MemoryTransport.egress``. ``config`` applies to every connection made through
    it; its ``link_rate``/``lane_rates`` shape the egress as a whole."""

    def __init__(self, network: NetworkHooks, config: TransportConfig | None = None, *,
                 private: bool = False) -> None:
        self.config = config if config is not None else TransportConfig()
        self._network = network
        self._private = private  # MemoryTransport.connect's: one connection, which carries the rates
        link, lanes = (None, {}) if private else (self.config.link_rate, dict(self.config.lane_rates))
        self._core = EgressCore(self.config, link, lanes)
        self._loop_run = network.add_egress(self._core)
        self._closed = False

    def _call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        if self._closed:
            raise ClosedError("the egress is closed")
        return self._loop_run(fn, timeout)

    def connect(self, address: tuple[str, int], *, timeout: float = 5.0) -> MemorySender:
        """Connect to the listener at ``address``; the connection shares this egress's
        scheduler and link rate. ``ConnectError`` if nobody listens there,
        ``ClosedError`` once the egress is closed."""
        address = (str(address[0]), int(address[1]))
        config = self.config
        shaper = (Shaper(CLOCK, config.link_rate, dict(config.lane_rates)) if self._private
                  else Shaper(CLOCK))
        conn = self._call(lambda: self._core.attach(self._network.find(address), shaper), timeout)
        return MemorySender(self, conn)

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape the egress: one rate for all connections together; ``None``: unshaped."""
        self._call(lambda: self._core.shaper.set_link_rate(rate))

    def peers(self) -> list[tuple[str, int]]:
        """``(host, port)`` of each live connection, oldest first."""
        return self._call(lambda: [c.address for c in self._core.conns.values()])

    def close(self, timeout: float = 5.0) -> None:
        """Close every connection (active streams fail with ``ClosedError``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._network.remove_egress(self._core, timeout)

    def __enter__(self) -> MemoryEgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:
    def _conforms(e: MemoryEgress, s: MemorySender) -> tuple[EgressLike, Sender]:
        return e, s  # mypy: the twin has the seam's shape
