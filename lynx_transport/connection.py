"""The sending side: ``connect`` to a receiver, then send streams over the connection.

Usage::

    with connect(("127.0.0.1", port), timeout=5) as conn:
        conn.set_link_rate(Rate(gbps=1.0))                 # optional shaping
        s = conn.send_stream([("k", k_anchor, Lane.ANCHOR),
                              ("v", v_residual, Lane.RESIDUAL)], metadata=b"layout")
        s.wait_lane(Lane.ANCHOR, timeout=5)                # receiver confirmed the anchor
        s.wait(timeout=30)                                 # ... and everything

    # regions produced progressively:
    s = conn.open_stream([("layer0", n0, Lane.ANCHOR), ("layer1", n1, Lane.ANCHOR)])
    s.supply("layer0", buf0); ...; s.supply("layer1", buf1)

Each connection has one I/O thread (``lynx-tx-io``) that owns its UCX worker
and endpoints (one per receive rail), the control socket, the :class:`PriorityScheduler` and the
:class:`Shaper`; public methods hand work to it and wait (with a timeout) for
the answer. Completion is signalled by the receiver (LANE_DONE/STREAM_DONE
frames), never inferred from local send completion.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import selectors
import socket
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from lynx_transport import _auth, _ucx
from lynx_transport._control import ControlSocket
from lynx_transport._loop import IoLoop
from lynx_transport._ucx import UcxWorker
from lynx_transport.clock import Clock, MonotonicClock
from lynx_transport.config import TransportConfig
from lynx_transport.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    ManifestError,
    PeerDisconnectedError,
    PoolExhaustedError,
    ProtocolError,
    StreamCancelledError,
    StreamFailedError,
    TransportError,
)
from lynx_transport.lanes import check_lane
from lynx_transport.manifest import Manifest, RegionSpec, encode_manifest
from lynx_transport.scheduler import Chunk, PriorityScheduler
from lynx_transport.send_stream import SendStream
from lynx_transport.shaper import Rate, Shaper
from lynx_transport.state import StreamState
from lynx_transport.stats import LaneCounters, TransportStats
from lynx_transport.wire import (
    NONCE_BYTES,
    Frame,
    FrameDecoder,
    FrameType,
    HelloFlags,
    OversizedFrame,
    RejectReason,
    WelcomeFlags,
    encode_frame,
    pack_chunk_sum,
    pack_hello,
    pack_u64,
    rail_of,
    unpack_challenge,
    unpack_rate,
    unpack_stream_lane,
    unpack_stream_text,
    unpack_stream_token,
    unpack_u64,
    unpack_welcome,
)

__all__ = ["Connection", "connect"]

log = logging.getLogger("lynx_transport")

_REJECT_ERRORS = {RejectReason.MANIFEST: ManifestError,
                  RejectReason.POOL_EXHAUSTED: PoolExhaustedError,
                  RejectReason.CLOSED: ClosedError}


@dataclasses.dataclass
class _TxStream:
    handle: SendStream
    views: list[Any | None]
    token: int | None = None
    inflight: int = 0
    cancelling: bool = False
    supplied: list[int] = dataclasses.field(default_factory=list)  # in supply order


class _TxLoop(IoLoop):
    def __init__(self, owner: Connection, sock: socket.socket, addresses: tuple[bytes, ...],
                 worker: UcxWorker) -> None:
        super().__init__("lynx-tx-io", owner.config.ucx_tls, owner.clock,
                         nice=owner.config.thread_nice, worker=worker)
        cfg = owner.config
        self.o = owner
        self.inflight: list[tuple[Any, Chunk, _TxStream]] = []
        self.quarantine: list[tuple[float, list[Any]]] = []
        # one endpoint per receive rail (see wire.rail_of, _receiver_rail)
        self.eps: list[Any] = []
        try:
            for address in addresses:
                self.eps.append(self.worker.endpoint(address))
        except BaseException:
            self.eps = []
            self.discard()
            raise
        self.ctl = ControlSocket(sock, 1 << 16, self.clock.now())
        self.shaper = Shaper(self.clock, cfg.link_rate, dict(cfg.lane_rates))
        self.sched = PriorityScheduler(self.clock, chunk_bytes=cfg.chunk_bytes,
                                       max_inflight_bytes=cfg.max_inflight_bytes, shaper=self.shaper)
        self.streams: dict[int, _TxStream] = {}
        self.counters = LaneCounters()
        self.completed = 0
        self.failed = 0
        self.broken: TransportError | None = None
        self.selector.register(sock, selectors.EVENT_READ, self.on_readable)

    def send(self, ftype: FrameType, payload: bytes = b"") -> None:
        self.ctl.send(ftype, payload, self.clock.now())

    def on_readable(self, sock: socket.socket) -> None:
        if self.ctl.closed:
            return
        try:
            for frame in self.ctl.read(self.clock.now()):
                if isinstance(frame, OversizedFrame):
                    raise ProtocolError(f"oversized {frame.type.name} frame from the receiver")
                self.on_frame(frame)
        except TransportError as exc:
            self.break_connection(exc)

    def on_frame(self, frame: Frame) -> None:
        t = frame.type
        if t is FrameType.ACCEPT:
            sid, token = unpack_stream_token(frame.payload)
            tx = self.streams.get(sid)
            if tx is None or tx.token is not None:
                return  # cancelled meanwhile, or a duplicate
            tx.token = token
            tx.handle._completion.activate()
            for i in tx.supplied:  # within a lane: first supplied, first sent
                self.queue_region(tx, i)
        elif t is FrameType.REJECT:
            sid, code, text = unpack_stream_text(frame.payload)
            tx = self.streams.get(sid)
            if tx is not None:
                try:
                    cls = _REJECT_ERRORS[RejectReason(code)]
                except (ValueError, KeyError):
                    cls = StreamFailedError
                self.fail(tx, cls(f"receiver refused stream {sid}: {text}"), StreamState.FAILED)
        elif t is FrameType.LANE_DONE:
            sid, lane = unpack_stream_lane(frame.payload)
            tx = self.streams.get(sid)
            if tx is not None:
                if lane not in tx.handle.manifest.lanes:
                    raise ProtocolError(f"LANE_DONE for lane {lane}, which stream {sid} does not use")
                if not tx.handle._completion.lane_done(lane, self.clock.now()):
                    raise ProtocolError(f"duplicate LANE_DONE for lane {lane} of stream {sid}")
        elif t is FrameType.LANE_GO:
            sid, lane = unpack_stream_lane(frame.payload, "LANE_GO")
            tx = self.streams.get(sid)
            if tx is not None:
                if lane not in tx.handle.manifest.lanes:
                    raise ProtocolError(f"LANE_GO for lane {lane}, which stream {sid} does not use")
                self.release_lane(tx, lane)
        elif t is FrameType.STREAM_DONE:
            tx = self.streams.get(unpack_u64(frame.payload, "STREAM_DONE"))
            if tx is not None and tx.handle._completion.finish(StreamState.COMPLETED, self.clock.now()):
                self.completed += 1
                self.forget(tx)
                # every byte is at the receiver: stop holding the caller's buffers
                # (a failed stream keeps them until its UCX requests are dropped)
                tx.views = [None] * len(tx.views)
        elif t is FrameType.STREAM_FAILED:
            sid, _, text = unpack_stream_text(frame.payload)
            tx = self.streams.get(sid)
            if tx is not None:
                self.fail(tx, StreamFailedError(f"receiver failed stream {sid}: {text}"),
                          StreamState.FAILED)
        elif t is FrameType.RATE:
            gbps, burst = unpack_rate(frame.payload)
            self.shaper.set_peer_rate(Rate(gbps, burst) if gbps > 0 else None)
        elif t is FrameType.HEARTBEAT:
            pass
        elif t is FrameType.GOODBYE:
            self.break_connection(PeerDisconnectedError("the receiver closed the connection"))
        else:
            raise ProtocolError(f"unexpected {t.name} frame from a receiver")

    # -- streams ------------------------------------------------------------------------
    def open(self, handle: SendStream, payload: bytes, views: list[Any | None]) -> None:
        if self.broken is not None:
            raise self.broken
        tx = _TxStream(handle, views, supplied=[i for i, v in enumerate(views) if v is not None])
        handle._supply = lambda i, buf: self.supply(tx, i, buf)
        handle._cancel = lambda: self.cancel(tx)
        handle._release_lane = lambda lane: self.release_lane(tx, lane)
        self.streams[handle.stream_id] = tx
        self.send(FrameType.OPEN, payload)

    def supply(self, tx: _TxStream, i: int, buffer: Any) -> None:
        if tx.handle.state.terminal:
            raise tx.handle.exception() or ClosedError(f"stream {tx.handle.stream_id} is finished")
        if tx.views[i] is not None:
            raise ValueError(f"region {tx.handle.manifest.regions[i].name!r} was already supplied")
        view = _ucx.as_bytes_view(buffer)
        spec = tx.handle.manifest.regions[i]
        if view.nbytes != spec.nbytes:
            raise ValueError(f"region {spec.name!r} is {spec.nbytes} bytes in the manifest, "
                             f"the buffer has {view.nbytes}")
        tx.views[i] = view
        tx.supplied.append(i)
        if tx.token is not None:
            self.queue_region(tx, i)

    def release_lane(self, tx: _TxStream, lane: int) -> None:
        """Schedule a held lane's supplied regions (in supply order); later ones follow."""
        if (tx.handle.state.terminal or tx.cancelling
                or not tx.handle._completion.lane_released(lane, self.clock.now())):
            return
        if tx.token is not None:
            for i in tx.supplied:
                if tx.handle.manifest.regions[i].lane == lane:
                    self.queue_region(tx, i)

    def queue_region(self, tx: _TxStream, i: int) -> None:
        spec = tx.handle.manifest.regions[i]
        if tx.handle._completion.is_held(spec.lane):
            return  # scheduled by release_lane
        first = tx.handle.manifest.first_chunk_indices()[i]
        self.sched.add_region(tx.handle.stream_id, i, spec.lane, spec.nbytes, first)

    def cancel(self, tx: _TxStream) -> None:
        if tx.handle.state.terminal or tx.cancelling:
            return
        tx.cancelling = True
        self.sched.remove_stream(tx.handle.stream_id)
        self.maybe_finish_cancel(tx)

    def maybe_finish_cancel(self, tx: _TxStream) -> None:
        # Chunks already handed to UCX finish first, so the receiver can safely
        # drop the receives that are left when CANCEL arrives.
        if tx.cancelling and tx.inflight == 0:
            if tx.handle._completion.finish(StreamState.CANCELLED, self.clock.now(),
                                            StreamCancelledError(
                                                f"stream {tx.handle.stream_id} was cancelled")):
                self.failed += 1
            self.forget(tx)
            if self.broken is None:
                self.send(FrameType.CANCEL, pack_u64(tx.handle.stream_id))

    def forget(self, tx: _TxStream) -> None:
        self.streams.pop(tx.handle.stream_id, None)
        self.sched.remove_stream(tx.handle.stream_id)

    def fail(self, tx: _TxStream, exc: TransportError, state: StreamState) -> None:
        if tx.handle._completion.finish(state, self.clock.now(), exc):
            self.failed += 1
        self.forget(tx)

    def break_connection(self, exc: TransportError) -> None:
        if self.broken is not None:
            return
        self.broken = exc
        if not isinstance(exc, (PeerDisconnectedError, ClosedError)):
            log.warning("connection to %s broken: %s", self.ctl.peer, exc)
        for tx in list(self.streams.values()):
            self.fail(tx, exc, StreamState.FAILED)
        # Requests (and the buffers they read) are dropped - which cancels
        # them - only after a grace period, as on the receiving side.
        self.quarantine.append((self.clock.now() + 0.2, self.inflight))
        self.inflight = []
        try:
            self.selector.unregister(self.ctl.sock)
        except (KeyError, ValueError):
            pass
        self.ctl.close()

    # -- the loop body ----------------------------------------------------------------------
    def step(self) -> tuple[bool, bool, float | None]:
        progressed = False
        now = self.clock.now()
        if self.inflight:
            keep = []
            for entry in self.inflight:
                req, chunk, tx = entry
                if not req.completed:
                    keep.append(entry)
                    continue
                progressed = True
                self.sched.complete(chunk)
                tx.inflight -= 1
                try:
                    _ucx.check(req, f"stream {chunk.stream_id}")
                except TransportError as exc:
                    self.inflight = keep
                    self.break_connection(exc)
                    return True, False, None
                self.counters.add(chunk.lane, chunk.nbytes, now)
                self.maybe_finish_cancel(tx)
            self.inflight = keep
        if self.broken is None:
            while (chunk := self.sched.next_chunk()) is not None:
                tx = self.streams[chunk.stream_id]
                view = tx.views[chunk.region][chunk.offset:chunk.offset + chunk.nbytes]
                self.counters.started(chunk.lane, now)
                if self.o._chunk_sums:
                    try:
                        self.send(FrameType.CHUNK_SUM, pack_chunk_sum(
                            chunk.stream_id, chunk.index, chunk.nbytes, _crc32(view)))
                    except TransportError as exc:
                        self.sched.complete(chunk)
                        self.break_connection(exc)
                        return True, False, None
                try:
                    req = self.worker.tag_send(self.eps[rail_of(chunk.index, len(self.eps))],
                                               view, (tx.token << 32) | chunk.index)
                except Exception as exc:  # noqa: BLE001 - mapped and reported
                    self.sched.complete(chunk)
                    self.break_connection(TransportError(f"UCX send failed: {exc}"))
                    return True, False, None
                tx.inflight += 1
                if tx.handle.started_at is None:
                    tx.handle.started_at = now
                self.inflight.append((req, chunk, tx))
                progressed = True
        return progressed, bool(self.inflight), self.housekeeping(now)

    def eager(self) -> bool:
        # A deep window of sends keeps the link busy by itself: sleep until UCX
        # reports progress instead of polling (the receiver's copy threads need
        # the cores); poll again once the window is half empty.
        return self.sched.inflight_bytes * 2 <= self.sched.max_inflight_bytes

    def housekeeping(self, now: float) -> float | None:
        if self.quarantine:
            self.quarantine = [(t, reqs) for t, reqs in self.quarantine if t > now]
        if self.broken is not None:
            return now + 0.05 if self.quarantine else None
        cfg = self.o.config
        try:
            self.ctl.flush()
            if now - self.ctl.last_rx > cfg.peer_timeout_s:
                raise PeerDisconnectedError(
                    f"receiver {self.ctl.peer} silent for {now - self.ctl.last_rx:.2f} s "
                    f"(limit {cfg.peer_timeout_s} s)")
            if now - self.ctl.last_tx >= cfg.heartbeat_interval_s:
                self.send(FrameType.HEARTBEAT)
        except TransportError as exc:
            self.break_connection(exc)
            return None
        # heartbeats may run a little late; only the shaper needs a precise wake-up
        deadline = max(now + 0.01, min(self.ctl.last_tx + cfg.heartbeat_interval_s,
                                       self.ctl.last_rx + cfg.peer_timeout_s))
        wait = self.sched.wait_time()
        if wait is not None:
            deadline = min(deadline, now + wait)
        return deadline

    def shutdown(self) -> None:
        if self.broken is None:
            try:
                self.send(FrameType.GOODBYE)
            except TransportError:
                pass
            self.break_connection(ClosedError("the connection was closed"))
        self.eps = []

    def on_crash(self, exc: BaseException) -> None:
        self.break_connection(TransportError(f"the I/O thread crashed: {exc!r}"))

    def release_ucx(self) -> None:
        self.inflight.clear()
        self.quarantine.clear()
        self.eps = []

    def stats(self) -> TransportStats:
        lanes = range(8)
        queued = {lane: self.sched.queued_bytes(lane) for lane in lanes}
        inflight = {lane: self.sched.inflight_lane_bytes(lane) for lane in lanes}
        return TransportStats(self.counters.snapshot(queued, inflight), len(self.streams),
                              self.completed, self.failed)


def _crc32(view: Any) -> int:
    """CRC32 of a chunk (host memory directly; device memory through a host copy)."""
    if hasattr(view, "__cuda_array_interface__"):
        view = view.get()
    return zlib.crc32(view)


class Connection:
    """A connection to one receiver. Create it with :func:`connect`."""

    def __init__(self, sock: socket.socket, addresses: tuple[bytes, ...], peer_rate: Rate | None,
                 config: TransportConfig, clock: Clock, worker: UcxWorker,
                 chunk_sums: bool = False) -> None:
        self.config = config
        self.clock = clock
        self._chunk_sums = chunk_sums
        self._ids = itertools.count(1)
        self._closed = False
        self._loop = _TxLoop(self, sock, addresses, worker)
        if peer_rate is not None:
            self._loop.shaper.set_peer_rate(peer_rate)
        self._loop.start()

    def _call(self, fn: Any, timeout: float = 5.0) -> Any:
        if self._closed:
            raise ClosedError("the connection is closed")
        return self._loop.run(fn, timeout)

    def open_stream(self, regions: Sequence[RegionSpec | tuple[str, int, int]],
                    metadata: bytes = b"", timeout: float = 5.0,
                    hold: Iterable[int] = ()) -> SendStream:
        """Announce a stream (names, sizes, lanes, metadata); supply bytes later with ``supply``.

        ``hold``: lanes that are not sent until released - by the receiver
        (``ReceiveStream.release_lane``) or here (``SendStream.release_lane``).
        Their regions can be supplied meanwhile.
        """
        specs = tuple(r if isinstance(r, RegionSpec) else RegionSpec(r[0], r[1], r[2])
                      for r in regions)
        return self._open(specs, [None] * len(specs), metadata, timeout, hold)

    def send_stream(self, regions: Sequence[tuple[str, Any, int]], metadata: bytes = b"",
                    timeout: float = 5.0, hold: Iterable[int] = ()) -> SendStream:
        """Send named buffers, each on a lane: ``[(name, buffer, lane), ...]``.

        Buffers (NumPy/CuPy arrays, bytes-like) must be contiguous and stay
        unchanged until the returned stream is done. ``timeout`` bounds only the
        hand-off to the I/O thread; wait on the stream for completion. ``hold``:
        as for :meth:`open_stream`.
        """
        views, specs = [], []
        for item in regions:
            if len(item) != 3:
                raise ValueError(f"regions are (name, buffer, lane) tuples, got {item!r}")
            name, buffer, lane = item
            view = _ucx.as_bytes_view(buffer)
            views.append(view)
            specs.append(RegionSpec(name, int(view.nbytes), lane))
        return self._open(tuple(specs), views, metadata, timeout, hold)

    def _open(self, specs: tuple[RegionSpec, ...], views: list[Any | None], metadata: bytes,
              timeout: float, hold: Iterable[int]) -> SendStream:
        manifest = Manifest(next(self._ids), self.config.chunk_bytes, specs, bytes(metadata))
        payload = encode_manifest(manifest, self.config.manifest_limits)
        held = frozenset(check_lane(lane) for lane in hold)
        if not held <= set(manifest.lanes):
            raise ValueError(f"cannot hold lanes {sorted(held - set(manifest.lanes))}: no region "
                             "travels on them")
        handle = SendStream(manifest, self.clock.now(), self._loop.run)
        handle._completion.hold(held)  # the lanes' one record, for the I/O thread and waiters
        self._call(lambda: self._loop.open(handle, payload, views), timeout)
        return handle

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape the whole connection (takes effect at once, also mid-stream)."""
        self._call(lambda: self._loop.shaper.set_link_rate(rate))

    def set_lane_rate(self, lane: int, rate: Rate | None) -> None:
        """Shape one lane (takes effect at once, also mid-stream)."""
        lane = check_lane(lane)
        self._call(lambda: self._loop.shaper.set_lane_rate(lane, rate))

    def rates(self) -> dict[str, Rate | None]:
        """Current shaping: link, the receiver's requested cap (``peer``), and lanes."""
        return self._call(self._loop.shaper.rates)

    def stats(self) -> TransportStats:
        """Per-lane bytes sent, achieved rates, queued and in-flight bytes."""
        return self._call(self._loop.stats)

    @property
    def broken(self) -> TransportError | None:
        """Why the connection can no longer be used (``None`` while it is healthy)."""
        return self._loop.broken

    def close(self, timeout: float = 5.0) -> None:
        """Fail active streams (``ClosedError``), say goodbye, stop the I/O thread."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop(timeout)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handshake(sock: socket.socket, deadline: float, clock: Clock,
               secret: bytes | None) -> tuple[tuple[bytes, ...], Rate | None, WelcomeFlags]:
    """HELLO -> [CHALLENGE -> PROOF ->] WELCOME; see :mod:`lynx_transport._auth`."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    flags = HelloFlags.AUTH if secret is not None else HelloFlags.NONE
    sock.sendall(encode_frame(FrameType.HELLO, pack_hello(flags, nonce_s)))
    decoder = FrameDecoder(1 << 17)
    proved = False
    while True:
        left = deadline - clock.now()
        if left <= 0:
            raise TimeoutError("handshake")
        sock.settimeout(left)
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectError("the receiver closed the connection during the handshake")
        for frame in decoder.feed(data):
            if not isinstance(frame, Frame):
                raise ConnectError(f"oversized {frame.type.name} frame during the handshake")
            if frame.type is FrameType.DENIED:
                _, _, text = unpack_stream_text(frame.payload)
                raise AuthenticationError(f"the receiver refused authentication: {text}")
            if frame.type is FrameType.CHALLENGE and secret is not None and not proved:
                nonce_r, mac_r = unpack_challenge(frame.payload)
                if not _auth.verify(_auth.receiver_mac(secret, nonce_s, nonce_r), mac_r):
                    raise AuthenticationError("the receiver failed to prove the shared secret "
                                              "(wrong secret, or not a Lynx receiver)")
                proved = True
                sock.sendall(encode_frame(FrameType.PROOF, _auth.sender_mac(secret, nonce_r, nonce_s)))
                continue
            if frame.type is not FrameType.WELCOME:
                raise ConnectError(f"expected WELCOME from the receiver, got {frame.type.name}")
            if secret is not None and not proved:
                # never hand an unauthenticated worker address to UCX
                raise AuthenticationError("the receiver did not authenticate (it has no shared "
                                          "secret configured); refusing its worker address")
            addresses, gbps, burst, wflags = unpack_welcome(frame.payload)
            return addresses, (Rate(gbps, burst) if gbps > 0 else None), wflags


def connect(address: tuple[str, int], *, timeout: float = 5.0,
            config: TransportConfig | None = None, clock: Clock | None = None) -> Connection:
    """Connect to a :class:`~lynx_transport.receiver.Receiver` at ``(host, port)``.

    ``timeout`` bounds the TCP connect and, again, the handshake; UCX starts in
    between (a process's first start takes about a second). Raises
    :class:`ConnectError` if nobody listens, the handshake fails, or either step
    does not finish within ``timeout`` seconds; :class:`AuthenticationError`
    (a ``ConnectError``) when ``config.secret`` and the receiver's disagree.
    """
    config = config if config is not None else TransportConfig()
    clock = clock if clock is not None else MonotonicClock()
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
    # UCX starts before HELLO: a process's first UCX context takes ~1 s (more on a
    # loaded host), and once it has sent WELCOME the receiver counts silence
    try:
        worker = UcxWorker(config.ucx_tls, config.ucx_net_devices or "all")
    except BaseException:
        sock.close()
        raise
    deadline = clock.now() + timeout
    try:
        ucx_addresses, peer_rate, wflags = _handshake(sock, deadline, clock, config.secret)
        return Connection(sock, ucx_addresses, peer_rate, config, clock, worker,
                          chunk_sums=bool(wflags & WelcomeFlags.CHUNK_SUMS))
    except BaseException as exc:
        sock.close()
        worker.close()
        if isinstance(exc, (OSError, ProtocolError)):
            raise ConnectError(f"handshake with {address[0]}:{address[1]} failed: {exc}") from exc
        raise
