"""The sender's I/O thread: one per egress, shared by every connection made through it.

The ``lynx-tx-io`` thread (see :mod:`lynx_transport.ucx.loop`) owns the UCX
worker, each peer's control socket and endpoints (one per receive rail), every
outgoing stream, the one :class:`PriorityScheduler` and the egress
:class:`Shaper`; the public faces (:class:`~lynx_transport.ucx.egress.Egress`,
:class:`~lynx_transport.ucx.connection.Connection`) hand work to it and wait for
the answer. A *peer* is one connection (one receiver): its own :class:`Shaper`
(a cap, the rate the receiver asked for, lane rates) applies on top of the
egress's.

Ids: stream ids come from one counter per egress (:attr:`SenderLoop.stream_ids`),
so they key the shared scheduler and travel on the wire unchanged (each
connection's ids are unique and increasing, as the receiver requires). A
frame from a receiver is looked up among that peer's streams only. Peers are
keyed by an int of their own.

A broken peer (closed, silent, a bad frame, a UCX error) fails only its
streams: it leaves the peer table and the scheduler at once, its chunks in
flight leave the shared window, and its requests and endpoints are dropped
together after a grace period (dropping an endpoint cancels its sends).
"""

from __future__ import annotations

import itertools
import logging
import selectors
import socket
import zlib
from collections.abc import Sequence
from typing import Any

from lynx_transport.config import TransportConfig
from lynx_transport.errors import (
    ClosedError,
    PeerDisconnectedError,
    ProtocolError,
    StreamCancelledError,
    StreamFailedError,
    TransportError,
)
from lynx_transport.lanes import MAX_LANES
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.scheduler import Chunk, PriorityScheduler
from lynx_transport.protocol.shaper import Rate, Shaper
from lynx_transport.protocol.views import as_bytes_view
from lynx_transport.protocol.wire import (
    Frame,
    FrameType,
    OversizedFrame,
    chunk_tag,
    pack_chunk_sum,
    pack_u64,
    rail_of,
    stream_token,
)
from lynx_transport.send_stream import SendStream
from lynx_transport.state import StreamState
from lynx_transport.stats import LaneCounters, TransportStats
from lynx_transport.ucx import adapter, sender_frames
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.control import ControlSocket
from lynx_transport.ucx.loop import IoLoop
from lynx_transport.ucx.sender_state import Peer, TxStream

__all__ = ["SenderLoop", "GRACE_S"]

log = logging.getLogger("lynx_transport")

#: A broken peer's UCX requests and endpoints are dropped this long after the break.
GRACE_S = 0.2

class SenderLoop(IoLoop):
    """The I/O thread of one egress. ``link``/``lanes``: the egress's own shaping."""

    def __init__(self, config: TransportConfig, clock: Clock, worker: UcxWorker,
                 link: Rate | None = None, lanes: dict[int, Rate] | None = None) -> None:
        super().__init__("lynx-tx-io", config.ucx_tls, clock, nice=config.thread_nice, worker=worker,
                         heartbeat_s=config.heartbeat_interval_s, busy_poll=config.busy_poll,
                         inline_calls=config.send_from_caller)
        self.heartbeat_s = config.heartbeat_interval_s
        self.peer_timeout_s = config.peer_timeout_s
        self.send_before_accept = config.send_before_accept
        self.shaper = Shaper(clock, link, lanes)
        self.sched = PriorityScheduler(clock, chunk_bytes=config.chunk_bytes,
                                       max_inflight_bytes=config.max_inflight_bytes,
                                       shaper=self.shaper, policy=config.lane_policy)
        #: Stream ids for every connection of this egress (``next`` is atomic: any thread).
        self.stream_ids = itertools.count(1)
        self.peers: dict[int, Peer] = {}
        self._peer_keys = itertools.count(1)
        self.inflight: list[tuple[Any, Chunk, TxStream]] = []
        # (until, requests, endpoints) of broken peers, dropped in that order
        self.quarantine: list[tuple[float, list[Any], list[Any]]] = []
        self.counters = LaneCounters()
        self.completed = 0
        self.failed = 0

    # -- peers ----------------------------------------------------------------------------
    def add_peer(self, sock: socket.socket, addresses: Sequence[bytes], shaper: Shaper,
                 chunk_sums: bool, conn_key: int = 0, max_open: int = 0) -> Peer:
        """Take over a welcomed control socket; reach the receiver's workers (``addresses``).
        ``conn_key``, ``max_open``: the WELCOME's (streams up to ``max_open`` manifest bytes
        are sent without waiting for their ACCEPT)."""
        eps = [self.worker.endpoint(address) for address in addresses]
        host, port = sock.getpeername()[:2]
        peer = Peer(next(self._peer_keys), ControlSocket(sock, 1 << 16, self.clock.now()), eps,
                    (host, port), shaper, chunk_sums, conn_key, max_open)
        self.peers[peer.key] = peer
        self.sched.add_peer(peer.key, shaper)
        assert self.heartbeats is not None  # made with heartbeat_s
        self.heartbeats.add(peer.ctl)
        self.selector.register(sock, selectors.EVENT_READ, lambda _sock: self.on_readable(peer))
        return peer

    def close_peer(self, peer: Peer) -> None:
        """An orderly close: GOODBYE, then the peer's streams fail with ``ClosedError``."""
        if peer.broken is None:
            try:
                peer.ctl.send(FrameType.GOODBYE, b"", self.clock.now())
            except TransportError:
                pass
            self.break_peer(peer, ClosedError("the connection was closed"))

    def break_peer(self, peer: Peer, exc: TransportError) -> None:
        """Fail ``peer``'s streams and free its state; the other peers carry on."""
        if peer.broken is not None:
            return
        peer.broken = exc
        self.peers.pop(peer.key, None)
        if not isinstance(exc, (PeerDisconnectedError, ClosedError)):
            log.warning("connection to %s broken: %s", peer.ctl.peer, exc)
        for tx in list(peer.streams.values()):
            self.fail(tx, exc, StreamState.FAILED)
        self.sched.remove_peer(peer.key)
        # its chunks in flight leave the shared window now; their requests (and the
        # buffers they read) and the endpoints are dropped - which cancels the
        # sends - only after a grace period, as on the receiving side
        mine = [entry for entry in self.inflight if entry[2].peer is peer]
        if mine:
            self.inflight = [entry for entry in self.inflight if entry[2].peer is not peer]
            for _, chunk, tx in mine:
                self.sched.complete(chunk)
                tx.inflight -= 1
        self.quarantine.append((self.clock.now() + GRACE_S, mine, peer.eps))
        peer.eps = []
        try:
            self.selector.unregister(peer.ctl.sock)
        except (KeyError, ValueError):
            pass
        if self.heartbeats is not None:
            self.heartbeats.discard(peer.ctl)
        peer.ctl.close()

    def on_readable(self, peer: Peer) -> None:
        if peer.ctl.closed:
            return
        try:
            for frame in peer.ctl.read(self.clock.now()):
                if isinstance(frame, OversizedFrame):
                    raise ProtocolError(f"oversized {frame.type.name} frame from the receiver")
                self.on_frame(peer, frame)
        except TransportError as exc:
            self.break_peer(peer, exc)

    def on_frame(self, peer: Peer, frame: Frame) -> None:
        sender_frames.on_frame(self, peer, frame)

    # -- streams ------------------------------------------------------------------------
    def open(self, peer: Peer, handle: SendStream, payload: bytes, views: list[Any | None]) -> None:
        if peer.broken is not None:
            raise peer.broken
        sid = handle.stream_id
        sent = self.send_before_accept and 0 < len(payload) <= peer.max_open
        token = stream_token(peer.conn_key, sid) if sent else None
        if sent and any(other.token == token for other in peer.streams.values()):
            raise StreamFailedError(f"stream {sid}'s tags are still used by a live stream "
                                    "(2**20 streams earlier); wait for it to finish")
        tx = TxStream(handle, peer, views, token, sent,
                      supplied=[i for i, v in enumerate(views) if v is not None])
        handle._supply = lambda i, buf: self.supply(tx, i, buf)
        handle._cancel = lambda: self.cancel(tx)
        handle._release_lane = lambda lane: self.release_lane(tx, lane)
        peer.streams[sid] = tx
        # OPEN_SENT: the chunks follow at once, no round trip before the first byte
        peer.ctl.send(FrameType.OPEN_SENT if sent else FrameType.OPEN, payload, self.clock.now())
        for i in tx.supplied if sent else ():
            self.queue_region(tx, i)

    def supply(self, tx: TxStream, i: int, buffer: Any) -> None:
        if tx.handle.state.terminal:
            raise tx.handle.exception() or ClosedError(f"stream {tx.handle.stream_id} is finished")
        if tx.views[i] is not None:
            raise ValueError(f"region {tx.handle.manifest.regions[i].name!r} was already supplied")
        view = as_bytes_view(buffer)
        spec = tx.handle.manifest.regions[i]
        if view.nbytes != spec.nbytes:
            raise ValueError(f"region {spec.name!r} is {spec.nbytes} bytes in the manifest, "
                             f"the buffer has {view.nbytes}")
        tx.views[i] = view
        tx.supplied.append(i)
        if tx.token is not None:
            self.queue_region(tx, i)

    def release_lane(self, tx: TxStream, lane: int) -> None:
        """Schedule a held lane's supplied regions (in supply order); later ones follow."""
        if (tx.handle.state.terminal or tx.cancelling
                or not tx.handle._completion.lane_released(lane, self.clock.now())):
            return
        if tx.token is not None:
            for i in tx.supplied:
                if tx.handle.manifest.regions[i].lane == lane:
                    self.queue_region(tx, i)

    def queue_region(self, tx: TxStream, i: int) -> None:
        spec = tx.handle.manifest.regions[i]
        if tx.handle._completion.is_held(spec.lane):
            return  # scheduled by release_lane
        first = tx.handle.manifest.first_chunk_indices()[i]
        self.sched.add_region(tx.handle.stream_id, i, spec.lane, spec.nbytes, first, peer=tx.peer.key)

    def cancel(self, tx: TxStream) -> None:
        if tx.handle.state.terminal or tx.cancelling:
            return
        tx.cancelling = True
        self.sched.remove_stream(tx.handle.stream_id)
        self.maybe_finish_cancel(tx)

    def maybe_finish_cancel(self, tx: TxStream) -> None:
        # Chunks already handed to UCX finish first, so the receiver can safely
        # drop the receives that are left when CANCEL arrives. A stream sent before
        # its ACCEPT and not accepted (yet) says it at once: its chunks wait for
        # receives only the receiver's drain (on CANCEL or REJECT) posts.
        if tx.cancel_sent or not tx.cancelling:
            return
        if tx.inflight == 0 or (tx.sent and not tx.accepted):
            tx.cancel_sent = True
            if tx.handle._completion.finish(StreamState.CANCELLED, self.clock.now(),
                                            StreamCancelledError(
                                                f"stream {tx.handle.stream_id} was cancelled")):
                tx.peer.failed += 1
                self.failed += 1
            self.forget(tx)
            if tx.peer.broken is None:
                try:
                    tx.peer.ctl.send(FrameType.CANCEL, pack_u64(tx.handle.stream_id), self.clock.now())
                except TransportError as exc:
                    self.break_peer(tx.peer, exc)

    def forget(self, tx: TxStream) -> None:
        tx.peer.streams.pop(tx.handle.stream_id, None)
        self.sched.remove_stream(tx.handle.stream_id)

    def fail(self, tx: TxStream, exc: TransportError, state: StreamState) -> None:
        if tx.handle._completion.finish(state, self.clock.now(), exc):
            tx.peer.failed += 1
            self.failed += 1
        self.forget(tx)

    # -- the loop body ----------------------------------------------------------------------
    def step(self) -> tuple[bool, bool, float | None]:
        progressed = False
        now = self.clock.now()
        if self.inflight:
            done: list[tuple[Any, Chunk, TxStream]] = []
            keep: list[tuple[Any, Chunk, TxStream]] = []
            for entry in self.inflight:
                (done if entry[0].completed else keep).append(entry)
            if done:
                progressed = True
                self.inflight = keep
                for req, sent, tx in done:
                    self.sched.complete(sent)
                    tx.inflight -= 1
                    if tx.peer.broken is not None:
                        continue  # broken by an earlier entry of this batch
                    try:
                        adapter.check(req, f"stream {sent.stream_id}")
                    except TransportError as exc:
                        self.break_peer(tx.peer, exc)
                        continue
                    tx.peer.counters.add(sent.lane, sent.nbytes, now)
                    self.counters.add(sent.lane, sent.nbytes, now)
                    self.maybe_finish_cancel(tx)
        progressed = self.send_ready(now) or progressed
        return progressed, bool(self.inflight), self.housekeeping(now)

    def send_ready(self, now: float) -> bool:
        """Hand every chunk the scheduler lets go now to UCX; True if any went."""
        sent = False
        while (chunk := self.sched.next_chunk()) is not None:
            sent = True
            self.send_chunk(chunk, now)
        return sent

    def after_inline_call(self) -> None:
        # a stream opened (or a region supplied, a lane released) on the caller's thread:
        # its first chunks leave from there too (``TransportConfig.send_from_caller``)
        self.send_ready(self.clock.now())

    def send_chunk(self, chunk: Chunk, now: float) -> None:
        """Hand one scheduled chunk to UCX (its CHUNK_SUM first, if the receiver asked)."""
        assert isinstance(chunk.peer, int)  # queued with a peer's key
        peer = self.peers[chunk.peer]  # live: a broken peer's chunks left the scheduler
        tx = peer.streams[chunk.stream_id]
        region = tx.views[chunk.region]
        assert region is not None and tx.token is not None  # scheduled once supplied and its token known
        view = region[chunk.offset:chunk.offset + chunk.nbytes]
        peer.counters.started(chunk.lane, now)
        self.counters.started(chunk.lane, now)
        try:
            if peer.chunk_sums:
                peer.ctl.send(FrameType.CHUNK_SUM, pack_chunk_sum(
                    chunk.stream_id, chunk.index, chunk.nbytes, _crc32(view)), now)
            try:
                req = self.worker.tag_send(peer.eps[rail_of(chunk.index, len(peer.eps))],
                                           view, chunk_tag(tx.token, chunk.index))
            except Exception as exc:
                raise TransportError(f"UCX send failed: {exc}") from exc
        except TransportError as exc:
            self.sched.complete(chunk)
            self.break_peer(peer, exc)
            return
        tx.inflight += 1
        if tx.handle.started_at is None:
            tx.handle.started_at = now
        self.inflight.append((req, chunk, tx))

    def eager(self) -> bool:
        # A deep window of sends keeps the link busy by itself: sleep until UCX
        # reports progress instead of polling (the receiver's copy threads need
        # the cores); poll again once the window is half empty.
        return self.sched.inflight_bytes * 2 <= self.sched.max_inflight_bytes

    def housekeeping(self, now: float) -> float | None:
        deadline: float | None = None
        if self.quarantine:
            keep = []
            for until, requests, eps in self.quarantine:
                if until > now:
                    keep.append((until, requests, eps))
                    deadline = until if deadline is None else min(deadline, until)
                else:
                    requests.clear()  # requests first, then their endpoints
                    eps.clear()
            self.quarantine = keep
        for peer in list(self.peers.values()):
            try:
                due = peer.ctl.keep_alive(now, self.heartbeat_s, self.peer_timeout_s, "receiver")
            except TransportError as exc:
                self.break_peer(peer, exc)
                continue
            deadline = due if deadline is None else min(deadline, due)
        if deadline is not None:
            # heartbeats may run a little late; only the shaper needs a precise wake-up
            deadline = max(now + 0.01, deadline)
        wait = self.sched.wait_time()
        if wait is not None:
            deadline = now + wait if deadline is None else min(deadline, now + wait)
        return deadline

    def shutdown(self) -> None:
        for peer in list(self.peers.values()):
            self.close_peer(peer)

    def on_crash(self, exc: BaseException) -> None:
        for peer in list(self.peers.values()):
            self.break_peer(peer, TransportError(f"the I/O thread crashed: {exc!r}"))

    def release_ucx(self) -> None:
        self.inflight.clear()
        for _, requests, eps in self.quarantine:
            requests.clear()
            eps.clear()
        self.quarantine.clear()
        for peer in self.peers.values():
            peer.eps = []

    # -- observability ------------------------------------------------------------------------
    def stats(self, peer: Peer | None = None) -> TransportStats:
        """The egress's counters, or one peer's (its share of the scheduler's queue too)."""
        lanes = range(MAX_LANES)
        if peer is None:
            queued = {lane: self.sched.queued_bytes(lane) for lane in lanes}
            inflight = {lane: self.sched.inflight_lane_bytes(lane) for lane in lanes}
            active = sum(len(p.streams) for p in self.peers.values())
            return TransportStats(self.counters.snapshot(queued, inflight), active,
                                  self.completed, self.failed)
        queued = {lane: self.sched.peer_queued_bytes(peer.key, lane) for lane in lanes}
        inflight = {lane: self.sched.peer_inflight_bytes(peer.key, lane) for lane in lanes}
        return TransportStats(peer.counters.snapshot(queued, inflight), len(peer.streams),
                              peer.completed, peer.failed)

    def peer_addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every live connection, oldest first."""
        return [peer.address for peer in self.peers.values()]


def _crc32(view: Any) -> int:
    """CRC32 of a chunk (host memory directly; device memory through a host copy)."""
    if hasattr(view, "__cuda_array_interface__"):
        view = view.get()
    return zlib.crc32(view)
