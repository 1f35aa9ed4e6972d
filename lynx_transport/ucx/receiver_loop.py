"""The receiver's I/O thread: accepting connections, the handshake, frames, admitting manifests.

Pool admission decisions come from :mod:`lynx_transport.protocol.admission`; an
admitted stream's chunks, completion and failure are
:class:`~lynx_transport.ucx.receiver_streams.RxStreams`'.

All state here is owned by the ``lynx-rx-io`` thread (see :mod:`lynx_transport.ucx.loop`);
the public face is :class:`lynx_transport.ucx.receiver.Receiver`, which hands the
loop what it needs (pool, config, clock, the callback thread's ``post``, the
callbacks, where opened streams go) rather than itself.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
from collections.abc import Callable, Mapping
from typing import Any

from lynx_transport.config import TransportConfig
from lynx_transport.errors import (
    ClosedError,
    ConnectError,
    ManifestError,
    PeerDisconnectedError,
    ProtocolError,
    StreamCancelledError,
    StreamFailedError,
    TransportError,
)
from lynx_transport.protocol.admission import AdmissionQueue, Admit, Wait
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.manifest import Manifest, decode_manifest
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.shaper import Rate
from lynx_transport.protocol.wire import (
    Frame,
    FrameType,
    OversizedFrame,
    RejectReason,
    pack_rate,
    pack_stream_lane,
    pack_stream_text,
    pack_stream_token,
    stream_token,
    unpack_stream_text,
    unpack_u64,
)
from lynx_transport.receive_stream import ReceivedRegion, ReceiveStream
from lynx_transport.state import StreamState
from lynx_transport.stats import LaneCounters, TransportStats
from lynx_transport.ucx import adapter, receiver_handshake
from lynx_transport.ucx.control import ControlSocket
from lynx_transport.ucx.loop import IoLoop
from lynx_transport.ucx.receiver_drain import Drains
from lynx_transport.ucx.receiver_quarantine import Quarantine
from lynx_transport.ucx.receiver_rail import RailLoop, cancel_receives, post_receives
from lynx_transport.ucx.receiver_state import RxPeer, RxStream
from lynx_transport.ucx.receiver_streams import RxStreams

__all__ = ["RxLoop", "CALLBACKS"]

log = logging.getLogger("lynx_transport")

#: Largest frame a peer may send before the handshake is done.
HANDSHAKE_MAX_PAYLOAD = 256

#: Heartbeats and quarantine may run this late; keeps the loop polling, not sleeping.
HOUSEKEEPING_SLACK_S = 0.01

#: The callbacks a receiver may set (``Receiver``'s keyword arguments).
CALLBACKS = ("on_stream_open", "on_chunk", "on_region", "on_lane_complete", "on_stream_complete",
             "on_stream_failed")


class RxLoop(IoLoop):
    """``post(callback, *args)`` runs a callback (``None``: skipped) on the callback
    thread; ``callbacks`` maps each name of :data:`CALLBACKS` to one (or ``None``);
    ``opened`` gets every admitted stream (for ``next_stream``), on this thread;
    ``release`` is what ``ReceiveStream.release`` calls."""

    def __init__(self, listen: socket.socket, pool: ReceivePool, config: TransportConfig,
                 clock: Clock, *, net_devices: str, post: Callable[..., None],
                 callbacks: Mapping[str, Callable[..., Any] | None],
                 opened: Callable[[ReceiveStream], None],
                 release: Callable[[ReceiveStream], None]) -> None:
        device = pool.device
        init = None if device is None else (lambda: adapter.ensure_cuda_context(device))
        super().__init__("lynx-rx-io", config.ucx_tls, clock, init,
                         net_devices=net_devices, nice=config.thread_nice,
                         heartbeat_s=config.heartbeat_interval_s, busy_poll=config.busy_poll)
        self.pool = pool
        self.config = config
        self.post = post
        self.cb = {name: callbacks.get(name) for name in CALLBACKS}
        self.opened = opened
        self.release = release
        self.requested_rate: Rate | None = None  # Receiver.request_rate, for every sender
        self.listen = listen
        self.conns: dict[int, RxPeer] = {}
        self.rails: list[RailLoop] = []
        # a failed stream's receives are cancelled on the rail that posted them
        self.quarantine = Quarantine(pool, lambda requests: cancel_receives(requests, self.rails))
        self.waiting: AdmissionQueue[RxPeer] = AdmissionQueue(pool, config.pool_wait_s,
                                                              lambda conn: conn.ctl.closed)
        self.counters = LaneCounters()
        self.streams = RxStreams(pool, clock, post, self.cb, self.quarantine, self.counters)
        self.max_payload = config.manifest_limits.max_encoded_bytes
        self.drains = Drains(self.worker, self.rails, self.quarantine, clock)
        try:
            for i in range(1, config.rails):
                self.rails.append(RailLoop(i, self.wake, config.ucx_tls, clock, init,
                                           net_devices, config.thread_nice))
        except BaseException:
            for rail in self.rails:
                rail.discard()
            self.discard()
            raise
        self.selector.register(listen, selectors.EVENT_READ, self.on_accept)

    def start(self) -> None:
        for rail in self.rails:
            rail.start()
        super().start()

    # -- sockets --------------------------------------------------------------------
    def on_accept(self, listen: socket.socket) -> None:
        while True:
            try:
                sock, _ = listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            now = self.clock.now()
            conn = RxPeer(ControlSocket(sock, HANDSHAKE_MAX_PAYLOAD, now), now)
            self.conns[conn.ctl.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, self.on_readable)

    def on_readable(self, sock: socket.socket) -> None:
        conn = self.conns.get(sock.fileno())
        if conn is None:
            return
        try:
            for frame in conn.ctl.read(self.clock.now()):
                self.on_frame(conn, frame)
        except TransportError as exc:
            self.drop_conn(conn, exc)

    def drop_conn(self, conn: RxPeer, exc: TransportError, quiet: bool = False) -> None:
        if conn.ctl.closed:
            return
        if conn.challenge is not None and not quiet:
            # challenged but never proved: a sender with another secret gives up here
            log.warning("refused connection from %s: authentication failed (no proof: %s)",
                        conn.ctl.peer, exc)
            quiet = True
        if not quiet and not isinstance(exc, (PeerDisconnectedError, ClosedError)):
            log.warning("dropping control connection from %s: %s", conn.ctl.peer, exc)
        for rx in list(conn.streams.values()):
            self.streams.fail(rx, exc, StreamState.FAILED)
        self.forget_waiting(conn)
        for sid in list(conn.draining):
            self.drains.end(conn, sid)
        if conn.key:
            self.quarantine.free_key(conn.key)
        try:
            self.selector.unregister(conn.ctl.sock)
        except (KeyError, ValueError):
            pass
        self.conns.pop(conn.ctl.fileno(), None)
        if self.heartbeats is not None:
            self.heartbeats.discard(conn.ctl)
        conn.ctl.close()

    # -- frames ------------------------------------------------------------------------
    def send(self, conn: RxPeer, ftype: FrameType, payload: bytes = b"") -> None:
        conn.ctl.send(ftype, payload, self.clock.now())

    def on_frame(self, conn: RxPeer, frame: Frame | OversizedFrame) -> None:
        if not conn.hello:
            receiver_handshake.on_handshake(self, conn, frame)
            return
        if isinstance(frame, OversizedFrame):
            sid = int.from_bytes(frame.prefix[:8].ljust(8, b"\0"), "big")
            self.reject(conn, sid, RejectReason.MANIFEST,
                        f"manifest of {frame.length} bytes exceeds the {self.max_payload}-byte limit")
            return
        t = frame.type
        if t is FrameType.OPEN or t is FrameType.OPEN_SENT:
            self.on_open(conn, frame.payload, sent=t is FrameType.OPEN_SENT)
        elif t is FrameType.CANCEL:
            sid = unpack_u64(frame.payload, "CANCEL")
            self.forget_waiting(conn, sid)
            self.drains.end(conn, sid)
            rx = conn.streams.get(sid)
            if rx is not None:
                self.streams.fail(rx, StreamCancelledError(
                    f"stream {rx.handle.stream_id} was cancelled by its sender"), StreamState.CANCELLED)
        elif t is FrameType.STREAM_FAILED:
            sid, _, text = unpack_stream_text(frame.payload)
            self.forget_waiting(conn, sid)
            self.drains.end(conn, sid)
            rx = conn.streams.get(sid)
            if rx is not None:
                self.streams.fail(rx, StreamFailedError(f"sender failed stream {sid}: {text}"),
                          StreamState.FAILED)
        elif t is FrameType.CHUNK_SUM:
            if not self.config.verify_chunks:
                raise ProtocolError("CHUNK_SUM from a sender that was not asked for checksums")
            self.streams.on_chunk_sum(conn, frame.payload)
        elif t is FrameType.HEARTBEAT:
            pass
        elif t is FrameType.GOODBYE:
            self.drop_conn(conn, PeerDisconnectedError(f"peer {conn.ctl.peer} closed the connection"))
        else:
            raise ProtocolError(f"unexpected {t.name} frame from a sender")

    def forget_waiting(self, conn: RxPeer, sid: int | None = None) -> None:
        """The sender gave up stream ``sid`` (every stream of ``conn`` when None) while it
        waited for pool space: never admitted; the chunks sent before (``OPEN_SENT``) are
        drained."""
        for _, peer, manifest in list(self.waiting.entries):
            if peer is conn and sid in (None, manifest.stream_id):
                self.drains.start(conn, manifest.stream_id, manifest)
        self.waiting.discard(conn, sid)

    def reject(self, conn: RxPeer, sid: int, reason: RejectReason, text: str,
               drain: Manifest | bytes | None = None) -> None:
        """Refuse stream ``sid``; one whose chunks are on their way (``OPEN_SENT``) has them
        drained (``drain``: its manifest, or the payload to read it from; :mod:`.receiver_drain`)."""
        log.warning("rejected stream %d from %s: %s", sid, conn.ctl.peer, text)
        self.drains.start(conn, sid, drain)
        self.send(conn, FrameType.REJECT, pack_stream_text(sid, reason, text))

    def request_rate(self, rate: Rate | None) -> None:
        """Ask every connected sender (and, in WELCOME, every later one) to hold to ``rate``."""
        self.requested_rate = rate
        payload = pack_rate(rate.gbps, rate.burst_bytes) if rate else pack_rate(0.0, 0)
        for conn in list(self.conns.values()):
            if conn.hello:
                try:
                    self.send(conn, FrameType.RATE, payload)
                except TransportError as exc:
                    self.drop_conn(conn, exc)

    def on_open(self, conn: RxPeer, payload: bytes, sent: bool = False) -> None:
        """OPEN, or OPEN_SENT (``sent``: the chunks are on their way with tags of the
        connection's key; they wait in UCX until admission posts their receives)."""
        limits = self.config.manifest_limits
        sid = int.from_bytes(payload[:8].ljust(8, b"\0"), "big")
        live = ("active" if sid in conn.streams
                else "waiting" if self.waiting.holds(conn, sid) else None)
        if sent:
            if (live or sid in conn.sent or sid in conn.draining
                    or self.quarantine.in_use(stream_token(conn.key, sid))):
                # two streams' chunks under one tag cannot be told apart
                raise ProtocolError(f"OPEN_SENT for stream {sid}, whose tags are still in use")
            conn.sent.add(sid)  # until admitted or drained
        try:
            manifest = decode_manifest(payload, limits)
        except ManifestError as exc:
            self.reject(conn, sid, RejectReason.MANIFEST, str(exc), payload)
            return
        if live:  # a plain OPEN (an OPEN_SENT raised above): nothing of it is on its way
            self.reject(conn, sid, RejectReason.MANIFEST, f"stream id {sid} is already {live}")
            return
        self.waiting.add(conn, manifest, self.clock.now())
        self.admit_waiting(self.clock.now())

    def admit_waiting(self, now: float) -> float | None:
        """Act on the pool's admission decisions (:mod:`lynx_transport.protocol.admission`):
        admit, reject with ``POOL_EXHAUSTED``, or return when the first waiting one gives up."""
        while (decision := self.waiting.next(now)) is not None:
            if isinstance(decision, Wait):
                return decision.until
            conn, manifest = decision.peer, decision.manifest
            try:
                if isinstance(decision, Admit):
                    self.admit(conn, manifest, decision.offsets)
                else:
                    self.reject(conn, manifest.stream_id, RejectReason.POOL_EXHAUSTED,
                                str(decision.error), manifest)
            except TransportError as err:
                self.drop_conn(conn, err)
        return None

    def admit(self, conn: RxPeer, manifest: Manifest, offsets: list[int]) -> None:
        sid = manifest.stream_id
        regions = tuple(ReceivedRegion(r.name, r.lane, r.nbytes, off)
                        for r, off in zip(manifest.regions, offsets))
        token = stream_token(conn.key, sid)
        self.quarantine.take_token(token)
        conn.sent.discard(sid)
        handle = ReceiveStream(manifest, regions, self.pool, conn.ctl.peer, self.release)
        rx = RxStream(handle, token, conn)
        conn.streams[sid] = rx
        handle._abandon = lambda reason, timeout: self.run(lambda: self.streams.abandon(rx, reason),
                                                           timeout)
        handle._go = lambda lane, timeout: self.run(lambda: self.lane_go(rx, lane), timeout)
        # the receives and the ACCEPT first, the callback thread after: waking it earlier
        # has it take the GIL while this thread still posts (the chunks may be waiting)
        try:
            post_receives(self.worker, self.rails, self.pool, rx, manifest, regions)
        except TransportError as exc:
            self.announce(handle)
            self.streams.fail(rx, exc, StreamState.FAILED, tell_peer=True)
            return
        handle._completion.activate()
        for lane in manifest.lanes:
            self.counters.started(lane, self.clock.now())
        self.send(conn, FrameType.ACCEPT, pack_stream_token(sid, rx.token))
        self.announce(handle)
        for index, nbytes, crc in conn.early_sums.pop(sid, ()):
            self.streams.add_sum(rx, index, nbytes, crc)
        self.streams.finish_empty(rx)

    def announce(self, handle: ReceiveStream) -> None:
        """An admitted stream goes to ``on_stream_open`` and ``next_stream`` (before any
        other callback of it)."""
        self.post(self.cb["on_stream_open"], handle)
        self.opened(handle)

    def lane_go(self, rx: RxStream, lane: int) -> None:
        """``ReceiveStream.release_lane``: let the sender send a lane it holds."""
        if rx.handle.state.terminal or lane not in rx.lanes_open or rx.conn.ctl.closed:
            return
        try:
            self.send(rx.conn, FrameType.LANE_GO, pack_stream_lane(rx.handle.stream_id, lane))
        except TransportError as exc:  # the stream fails with the connection
            self.drop_conn(rx.conn, exc)

    # -- the loop body ------------------------------------------------------------------------
    def step(self) -> tuple[bool, bool, float | None]:
        progressed = False
        pending = False
        now = self.clock.now()
        verify = self.config.verify_chunks
        for conn in list(self.conns.values()):
            for rx in list(conn.streams.values()):
                for _, q in sorted(rx.pending.items()):  # lane priority: lane 0 first
                    for p in q.pop_completed():
                        progressed = True
                        conn.ctl.heard(now)  # data from the peer: a sign of life
                        try:
                            adapter.check(p.request, f"stream {rx.handle.stream_id}")
                        except TransportError as exc:
                            self.streams.fail(rx, exc, StreamState.FAILED, tell_peer=True)
                            break
                        if verify and not self.streams.verify_chunk(rx, p):
                            if rx.handle.state.terminal:
                                break
                            continue  # parked until its CHUNK_SUM arrives
                        self.streams.chunk_landed(rx, p, now)
                        if rx.handle.state.terminal:
                            break
                    if rx.handle.state.terminal:
                        break
                    pending = pending or bool(q)
        deadline = self.housekeeping(now)
        return progressed, pending, deadline

    def housekeeping(self, now: float) -> float | None:
        cfg = self.config
        deadline = now + cfg.heartbeat_interval_s
        for conn in list(self.conns.values()):
            try:
                if conn.hello:
                    due = conn.ctl.keep_alive(now, cfg.heartbeat_interval_s, cfg.peer_timeout_s)
                else:
                    # in the handshake: bound by handshake_timeout_s, not by the silence limit (a
                    # sender starting UCX on a busy host may take a while to say HELLO)
                    if now - conn.accepted_at > cfg.handshake_timeout_s:
                        raise ConnectError(f"peer {conn.ctl.peer} did not finish the handshake "
                                           f"within {cfg.handshake_timeout_s} s")
                    conn.ctl.flush()
                    due = conn.accepted_at + cfg.handshake_timeout_s
            except TransportError as exc:
                self.drop_conn(conn, exc)
                continue
            deadline = min(deadline, due)
        held = self.quarantine.sweep(now)
        if held is not None:
            deadline = min(deadline, held)
        if self.waiting:
            admit_at = self.admit_waiting(now)
            if admit_at is not None:
                deadline = min(deadline, admit_at)
        # housekeeping may run a little late: never ask the loop for a precise sleep
        return max(deadline, now + HOUSEKEEPING_SLACK_S)

    def shutdown(self) -> None:
        for conn in list(self.conns.values()):
            try:
                if conn.hello:
                    self.send(conn, FrameType.GOODBYE)
            except TransportError:
                pass
            self.drop_conn(conn, ClosedError("the receiver was closed"))
        self.quarantine.release_all()
        try:
            self.selector.unregister(self.listen)
        except (KeyError, ValueError):
            pass
        self.listen.close()
        # no stream holds a rail's request any more: each rail drops its own
        for rail in self.rails:
            rail.stop(5.0)

    def on_crash(self, exc: BaseException) -> None:
        err = TransportError(f"the receiver's I/O thread crashed: {exc!r}")
        for conn in list(self.conns.values()):
            self.drop_conn(conn, err)

    def release_ucx(self) -> None:
        for conn in self.conns.values():
            for rx in conn.streams.values():
                rx.pending.clear()
        self.quarantine.drop_requests()

    def stats(self) -> TransportStats:
        inflight: dict[int, int] = collections.defaultdict(int)
        for conn in self.conns.values():
            for rx in conn.streams.values():
                for lane, q in rx.pending.items():
                    inflight[lane] += sum(p.nbytes for p in q)
        active = sum(len(c.streams) for c in self.conns.values())
        return TransportStats(self.counters.snapshot({}, inflight), active, self.streams.completed,
                              self.streams.failed)


