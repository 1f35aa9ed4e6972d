"""An in-process twin of the UCX transport: :class:`MemoryTransport`, no sockets, no UCX.

It implements :class:`lynx_transport.seam.Transport` with the transport's own parts
wherever they are not UCX: the stream handles (``SendStream``, ``ReceiveStream``,
driven through their ``Completion`` and the hooks the UCX I/O loops set), the
``ReceivePool``, manifest validation (the sender's ``ManifestLimits`` when it
opens, the listener's when it admits), an egress's one ``PriorityScheduler`` and
``Shaper`` shared by its connections, each connection's own ``Shaper`` (strict
lane priority across all of an egress's peers, the lane policy within a lane,
pacing; :mod:`lynx_transport.memory.egress`) and a ``Dispatcher`` for
callbacks. Each event raises the class (and message) the UCX transport raises
for it. Addresses are ``(host, port)`` within one instance.

Layout: this module is the network (:class:`MemoryTransport`: its listeners and
egresses, the thread's round) and the receiving side (:class:`MemoryListener`);
:mod:`lynx_transport.memory.egress` the sending side (``MemoryEgress``,
``MemorySender``); :mod:`lynx_transport.memory.loop` the thread. Imports point one
way, from here to the sending side: a listener hands its connections a
``ListenerHooks`` and the network its egresses a ``NetworkHooks`` (callables, built
here), and the listeners call the egress core's public methods.

Concurrency model (threads + futures, as :mod:`lynx_transport.ucx.loop`): each
``MemoryTransport`` has ONE thread (``lynx-mem-net``, running while a listener
or an egress is open) that owns the state of every listener, egress and
connection, both ends of every stream. Sender, egress, listener and stream
methods hand it work through :meth:`NetLoop.run` (a future, waited with a
timeout). Each round it admits what waits for pool space and, for each egress,
copies the one chunk its scheduler picks from the sender's buffer into the
pool, accounts it as the receiver does, and updates the sender's completion
where a ``LANE_DONE``/``STREAM_DONE`` frame would. Callbacks run on each
listener's own ``lynx-mem-callbacks`` thread.

Not modelled: the handshake, ``secret``, heartbeats and ``peer_timeout_s``,
chunk checksums, rails, a peer that dies without closing, ``stats``, lane rates
set after the start and ``request_rate``; nothing is ever in flight between
rounds (the in-flight window is one chunk). A failed stream's pool blocks are
freed at once (UCX: 0.2 s).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lynx_transport._dispatch import Dispatcher
from lynx_transport._opened import OpenedStreams
from lynx_transport.config import TransportConfig
from lynx_transport.errors import (
    ClosedError,
    ConnectError,
    ManifestError,
    PeerDisconnectedError,
    PoolExhaustedError,
    StreamCancelledError,
    StreamFailedError,
    TransportError,
)
from lynx_transport.memory.egress import (
    EgressCore,
    EgressPeer,
    ListenerHooks,
    MemoryEgress,
    MemorySender,
    NetworkHooks,
    StreamEnds,
)
from lynx_transport.memory.loop import CLOCK, NetLoop
from lynx_transport.protocol.admission import AdmissionQueue, Admit, Wait
from lynx_transport.protocol.manifest import Manifest, decode_manifest
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.scheduler import Chunk
from lynx_transport.receive_stream import ReceivedRegion, ReceiveStream
from lynx_transport.seam import ReceiverCallbacks
from lynx_transport.state import StreamState

if TYPE_CHECKING:
    from lynx_transport.seam import Transport

__all__ = ["MemoryTransport", "MemoryEgress", "MemorySender", "MemoryListener"]

_FIRST_PORT = 49152  # where the kernel's ephemeral ports start


class MemoryListener:
    """The receiving side (:class:`lynx_transport.seam.Listener`); from ``MemoryTransport.listen``."""

    def __init__(self, network: MemoryTransport, pool: ReceivePool, address: tuple[str, int],
                 config: TransportConfig, callbacks: ReceiverCallbacks) -> None:
        self.pool, self.config, self._network, self._address, self._cb = (
            pool, config, network, address, callbacks)
        self._run = network._loop.run
        self._opened = OpenedStreams()
        self._conns: list[EgressPeer] = []
        self._waiting: AdmissionQueue[StreamEnds] = AdmissionQueue(pool, config.pool_wait_s)
        self._dispatch = Dispatcher("lynx-mem-callbacks", config.thread_nice)
        #: What a connection's egress calls (the sender's frames); the listener never hands itself.
        self._hooks = ListenerHooks(address, self._attach, self._detach, self._accept, self._deliver,
                                   self._fail_rx, self._unwait)

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def next_stream(self, timeout: float) -> ReceiveStream:
        return self._opened.next(timeout)

    def close(self, timeout: float = 5.0) -> None:
        if not self._opened.close():
            return
        try:
            self._run(self._shut, timeout)
        finally:
            self._dispatch.stop(timeout)  # the callbacks of what failed run before close returns
            self._network._loop.release(timeout)

    def __enter__(self) -> MemoryListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the network thread: connections and opening -----------------------------------------
    def _attach(self, conn: EgressPeer) -> None:
        if self._opened.closed:
            raise ConnectError(f"cannot connect to {self._address[0]}:{self._address[1]}: "
                               "the listener was closed")
        self._conns.append(conn)

    def _detach(self, conn: EgressPeer) -> None:
        if conn in self._conns:
            self._conns.remove(conn)

    def _accept(self, s: StreamEnds, payload: bytes) -> None:
        """What the receiver does with the OPEN frame."""
        try:
            manifest = decode_manifest(payload, self.config.manifest_limits)
        except ManifestError as exc:
            s.conn.egress.fail_tx(s, ManifestError(f"receiver refused stream {s.tx.stream_id}: {exc}"))
            return
        self._waiting.add(s, manifest, CLOCK.now())
        self._admit_waiting(CLOCK.now())

    def _admit_waiting(self, now: float) -> float | None:
        """Act on the pool's admission decisions (``AdmissionQueue``, as ``RxLoop`` does);
        returns when the first one that waits gives up."""
        while (decision := self._waiting.next(now)) is not None:
            if isinstance(decision, Wait):
                return decision.until
            s, manifest = decision.peer, decision.manifest
            if isinstance(decision, Admit):
                self._admit(s, manifest, decision.offsets)
            else:
                s.conn.egress.fail_tx(s, PoolExhaustedError(
                    f"receiver refused stream {manifest.stream_id}: {decision.error}"))
        return None

    def _unwait(self, s: StreamEnds) -> None:
        self._waiting.discard(s)

    def _admit(self, s: StreamEnds, manifest: Manifest, offsets: list[int]) -> None:
        regions = tuple(ReceivedRegion(r.name, r.lane, r.nbytes, off)
                        for r, off in zip(manifest.regions, offsets))
        rx = s.rx = ReceiveStream(manifest, regions, self.pool, s.conn.peer, self._release_from_user)
        s.region_left, s.left = [r.nbytes for r in regions], manifest.total_bytes
        for r in regions:
            s.lane_left[r.lane] += r.nbytes
        rx._abandon = lambda reason, timeout: self._run(lambda: self._abandon(s, reason), timeout)
        rx._go = lambda lane, timeout: self._run(lambda: self._lane_go(s, lane), timeout)
        self._dispatch.post(self._cb.on_stream_open, rx)
        self._opened.put(rx)
        rx._completion.activate()
        s.tx._completion.activate()  # the ACCEPT frame
        s.accepted = True
        for i in s.supplied:
            s.conn.egress.queue(s, i)
        now = CLOCK.now()  # what has no bytes is done at once: regions, then lanes, then the stream
        for i in (i for i, r in enumerate(regions) if r.nbytes == 0):
            self._region_done(s, i)
        for lane in sorted(lane for lane, left in s.lane_left.items() if left == 0):
            self._lane_done(s, lane, now)
        if s.left == 0:
            self._stream_done(s, now)

    # -- on the network thread: the receiver's hooks ------------------------------------------------
    def _lane_go(self, s: StreamEnds, lane: int) -> None:
        if s.rx is not None and not s.rx.state.terminal and s.lane_left[lane] and s.conn.broken is None:
            s.conn.egress.release(s, lane)  # the LANE_GO frame

    def _abandon(self, s: StreamEnds, reason: str) -> None:
        exc = StreamCancelledError(f"stream {s.tx.stream_id} was abandoned by the receiver: {reason}")
        if self._fail_rx(s, exc, StreamState.CANCELLED):  # and the STREAM_FAILED frame
            s.conn.egress.fail_tx(s, StreamFailedError(f"receiver failed stream {s.tx.stream_id}: {exc}"))

    def _release_from_user(self, stream: ReceiveStream) -> None:
        def free() -> None:
            for r in stream.regions:
                self.pool.release(r.offset, r.nbytes)
            self._admit_waiting(CLOCK.now())
        self._run(free, 5.0)

    # -- on the network thread: bytes landing ----------------------------------------------------------
    def _deliver(self, s: StreamEnds, chunk: Chunk, now: float) -> None:
        """Copy one chunk the sender's scheduler picked into the pool."""
        if s.rx is None or s.rx.state.terminal:
            return
        region, view = s.rx.regions[chunk.region], s.views[chunk.region]
        assert view is not None  # only supplied regions are queued
        try:
            _copy(self.pool.view(region.offset + chunk.offset, chunk.nbytes),
                  view[chunk.offset:chunk.offset + chunk.nbytes])
        except Exception as exc:  # noqa: BLE001 - mapped and reported, like a failed UCX request
            err = TransportError(f"stream {chunk.stream_id}: copying a chunk failed: {exc}")
            if self._fail_rx(s, err, StreamState.FAILED):
                s.conn.egress.fail_tx(s, StreamFailedError(f"receiver failed stream {chunk.stream_id}: {err}"))
            return
        if s.tx.started_at is None:
            s.tx.started_at = now
        self._dispatch.post(self._cb.on_chunk, s.rx, region, chunk.offset, chunk.nbytes)
        self._landed(s, chunk.region, chunk.nbytes, now)

    def _landed(self, s: StreamEnds, i: int, nbytes: int, now: float) -> None:
        """``nbytes`` more of region ``i`` are in the pool (the receiver's accounting)."""
        lane = s.tx.manifest.regions[i].lane
        s.region_left[i] -= nbytes
        s.lane_left[lane] -= nbytes
        s.left -= nbytes
        if s.region_left[i] == 0:
            self._region_done(s, i)
        if s.lane_left[lane] == 0:
            self._lane_done(s, lane, now)
        if s.left == 0:
            self._stream_done(s, now)

    def _region_done(self, s: StreamEnds, i: int) -> None:
        assert s.rx is not None
        s.rx._completion.region_done(s.rx.regions[i].name)
        self._dispatch.post(self._cb.on_region, s.rx, s.rx.regions[i])

    def _lane_done(self, s: StreamEnds, lane: int, now: float) -> None:
        assert s.rx is not None
        if s.rx._completion.lane_done(lane, now):
            s.tx._completion.lane_done(lane, now)  # the LANE_DONE frame
            self._dispatch.post(self._cb.on_lane_complete, s.rx, lane)

    def _stream_done(self, s: StreamEnds, now: float) -> None:
        rx = s.rx
        assert rx is not None
        if rx._completion.finish(StreamState.COMPLETED, now):
            rx._abandon = rx._go = None
            s.tx._completion.finish(StreamState.COMPLETED, now)  # the STREAM_DONE frame
            s.conn.egress.forget(s)
            self._dispatch.post(self._cb.on_stream_complete, rx)

    # -- on the network thread: endings -----------------------------------------------------------------
    def _fail_rx(self, s: StreamEnds, exc: TransportError, state: StreamState) -> bool:
        rx = s.rx
        if rx is None or not rx._completion.finish(state, CLOCK.now(), exc):
            return False
        rx._abandon = rx._go = None
        if rx._mark_released():
            for r in rx.regions:
                self.pool.release(r.offset, r.nbytes)
        self._dispatch.post(self._cb.on_stream_failed, rx, exc)
        return True

    def _shut(self) -> None:
        """The listener closes: it leaves the network, every connection to it ends."""
        self._network._listeners.pop(self._address, None)
        self._end(ClosedError("the receiver was closed"),
                  PeerDisconnectedError("the receiver closed the connection"))

    def _end(self, rx_exc: TransportError, tx_exc: TransportError) -> None:
        """Every connection to the listener ends: its receiving ends fail with ``rx_exc``,
        its sending ends with ``tx_exc``."""
        for conn in list(self._conns):
            conn.egress.drop(conn, rx_exc, tx_exc)
        self._waiting.clear()


def _copy(dst: Any, src: Any) -> None:
    if hasattr(dst, "__cuda_array_interface__") or hasattr(src, "__cuda_array_interface__"):
        import cupy  # noqa: PLC0415 - only for a CUDA pool or a CUDA buffer

        cupy.asarray(dst)[...] = cupy.asarray(src)
    else:
        dst[...] = src


class MemoryTransport:
    """An in-process :class:`~lynx_transport.seam.Transport`; each instance is its own network
    (one thread, running while one of its listeners or egresses is open)."""

    def __init__(self) -> None:
        self._loop = NetLoop("lynx-mem-net", CLOCK, self._step, self._crashed)
        # owned by the network thread
        self._listeners: dict[tuple[str, int], MemoryListener] = {}
        self._egresses: list[EgressCore] = []
        self._ports = itertools.count(_FIRST_PORT)
        self._hooks = NetworkHooks(self._add_egress, self._remove_egress, self._find)

    def __repr__(self) -> str:
        return "MemoryTransport()"

    def connect(self, address: tuple[str, int], *, timeout: float,
                config: TransportConfig | None = None) -> MemorySender:
        egress = MemoryEgress(self._hooks, config, private=True)  # closed with the connection
        try:
            return egress.connect(address, timeout=timeout)
        except BaseException:
            egress.close(timeout)
            raise

    def egress(self, config: TransportConfig | None = None) -> MemoryEgress:
        return MemoryEgress(self._hooks, config)

    def listen(self, pool: ReceivePool, *, host: str = "127.0.0.1", port: int = 0,
               config: TransportConfig | None = None,
               callbacks: ReceiverCallbacks | None = None) -> MemoryListener:
        cfg = config if config is not None else TransportConfig()
        cbs = callbacks if callbacks is not None else ReceiverCallbacks()

        def bind() -> MemoryListener:
            nonlocal port
            if port == 0:
                port = next(p for p in self._ports if (host, p) not in self._listeners)
            elif (host, port) in self._listeners:
                raise TransportError(f"cannot listen on {host}:{port}: the address is in use")
            listener = self._listeners[host, port] = MemoryListener(self, pool, (host, port), cfg, cbs)
            return listener

        return self._start(bind)

    # -- for the egresses and listeners --------------------------------------------------------------
    def _start(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the network thread, as one more user of it (released on failure)."""
        self._loop.acquire()
        try:
            return self._loop.run(fn, 5.0)
        except BaseException:
            self._loop.release(5.0)
            raise

    def _add_egress(self, core: EgressCore) -> Callable[[Callable[[], Any], float], Any]:
        self._start(lambda: self._egresses.append(core))
        return self._loop.run

    def _remove_egress(self, core: EgressCore, timeout: float) -> None:
        def remove() -> None:
            core.close()
            if core in self._egresses:
                self._egresses.remove(core)
        try:
            self._loop.run(remove, timeout)
        finally:
            self._loop.release(timeout)

    def _find(self, address: tuple[str, int]) -> ListenerHooks:
        listener = self._listeners.get(address)
        if listener is None:
            raise ConnectError(f"cannot connect to {address[0]}:{address[1]}: nobody listens "
                               "there (in-memory transport)")
        return listener._hooks

    # -- on the network thread ---------------------------------------------------------------------------
    def _step(self) -> tuple[bool, float | None]:
        now = CLOCK.now()
        progressed, deadline = False, None
        for listener in list(self._listeners.values()):
            if listener._waiting:
                deadline = _earliest(deadline, listener._admit_waiting(now))
        for egress in list(self._egresses):
            moved, due = egress.step(now)
            progressed, deadline = progressed or moved, _earliest(deadline, due)
        return progressed, deadline

    def _crashed(self, error: TransportError) -> None:
        for listener in list(self._listeners.values()):
            listener._end(error, error)
        for egress in self._egresses:
            for conn in list(egress.conns.values()):
                egress.drop(conn, error, error)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


if TYPE_CHECKING:
    _conforms: Transport = MemoryTransport()  # mypy: the twin has the seam's shape
