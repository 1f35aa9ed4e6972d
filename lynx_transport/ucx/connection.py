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

A :class:`Connection` is a handle on one peer of a sender I/O thread
(:mod:`lynx_transport.ucx.sender_loop`: ``lynx-tx-io``, which owns the UCX worker,
the endpoints, the control sockets, the :class:`PriorityScheduler` and the
shapers). :func:`connect` gives the connection an egress of its own - one I/O
thread, owned by the connection and stopped with it; a sending node with
several receivers shares one among all its connections instead
(:class:`lynx_transport.ucx.egress.Egress`), so lane priority and shaping hold
across them. Public methods hand work to the I/O thread and wait (with a
timeout) for the answer. Completion is signalled by the receiver
(LANE_DONE/STREAM_DONE frames), never inferred from local send completion.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lynx_transport.config import TransportConfig
from lynx_transport.errors import (
    AuthenticationError,
    ClosedError,
    ConnectError,
    ProtocolError,
    TransportError,
)
from lynx_transport.lanes import check_lane
from lynx_transport.protocol import auth
from lynx_transport.protocol.clock import Clock, MonotonicClock
from lynx_transport.protocol.manifest import Manifest, RegionSpec, encode_manifest
from lynx_transport.protocol.shaper import Rate, Shaper
from lynx_transport.protocol.views import as_bytes_view
from lynx_transport.protocol.wire import (
    NONCE_BYTES,
    Frame,
    FrameDecoder,
    FrameType,
    HelloFlags,
    WelcomeFlags,
    encode_frame,
    pack_hello,
    unpack_challenge,
    unpack_stream_text,
    unpack_welcome,
)
from lynx_transport.send_stream import SendStream
from lynx_transport.stats import TransportStats
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.sender_loop import SenderLoop
from lynx_transport.ucx.sender_state import Peer

__all__ = ["Connection", "connect"]


class Connection:
    """A connection to one receiver. Create it with :func:`connect` (an egress of its
    own) or :meth:`Egress.connect <lynx_transport.ucx.egress.Egress.connect>` (shared)."""

    def __init__(self, loop: SenderLoop, peer: Peer, config: TransportConfig, clock: Clock,
                 owns_loop: bool) -> None:
        self.config = config
        self.clock = clock
        self._loop = loop
        self._peer = peer
        self._owns_loop = owns_loop
        self._closed = False

    def _call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        if self._closed:
            raise ClosedError("the connection is closed")
        return self._loop.run(fn, timeout)

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of the receiver's control channel."""
        return self._peer.address

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
            view = as_bytes_view(buffer)
            views.append(view)
            specs.append(RegionSpec(name, int(view.nbytes), lane))
        return self._open(tuple(specs), views, metadata, timeout, hold)

    def _open(self, specs: tuple[RegionSpec, ...], views: list[Any | None], metadata: bytes,
              timeout: float, hold: Iterable[int]) -> SendStream:
        # ids from the egress's one counter: unique across its connections (the
        # scheduler's keys) and, per connection, unique and increasing (the wire's)
        manifest = Manifest(next(self._loop.stream_ids), self.config.chunk_bytes, specs,
                            bytes(metadata))
        payload = encode_manifest(manifest, self.config.manifest_limits)
        held = frozenset(check_lane(lane) for lane in hold)
        if not held <= set(manifest.lanes):
            raise ValueError(f"cannot hold lanes {sorted(held - set(manifest.lanes))}: no region "
                             "travels on them")
        handle = SendStream(manifest, self.clock.now(), self._loop.run)
        handle._completion.hold(held)  # the lanes' one record, for the I/O thread and waiters
        self._call(lambda: self._loop.open(self._peer, handle, payload, views), timeout)
        return handle

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape this connection (takes effect at once, also mid-stream); ``None``: unshaped.

        On a connection from :func:`connect` that is the whole link. On a
        shared :class:`~lynx_transport.ucx.egress.Egress` it is a cap for this
        peer only: the egress's own rate (``Egress.set_link_rate``) holds for
        all peers together on top of it, and a peer over its cap does not hold
        back the others.
        """
        self._call(lambda: self._peer.shaper.set_link_rate(rate))

    def set_lane_rate(self, lane: int, rate: Rate | None) -> None:
        """Shape one lane of this connection (at once, also mid-stream; per peer on a
        shared egress, like :meth:`set_link_rate`)."""
        lane = check_lane(lane)
        self._call(lambda: self._peer.shaper.set_lane_rate(lane, rate))

    def rates(self) -> dict[str, Rate | None]:
        """This connection's shaping: ``link`` (:meth:`set_link_rate`), the receiver's
        requested cap (``peer``), and lanes (``lane0``, ...)."""
        return self._call(self._peer.shaper.rates)

    def stats(self) -> TransportStats:
        """Per-lane bytes sent, achieved rates, queued and in-flight bytes (this connection's)."""
        return self._call(lambda: self._loop.stats(self._peer))

    @property
    def broken(self) -> TransportError | None:
        """Why the connection can no longer be used (``None`` while it is healthy)."""
        return self._peer.broken

    def close(self, timeout: float = 5.0) -> None:
        """Fail active streams (``ClosedError``), say goodbye; stop the I/O thread if it
        is this connection's own. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_loop:
            self._loop.stop(timeout)
            return
        try:
            self._loop.run(lambda: self._loop.close_peer(self._peer), timeout)
        except ClosedError:
            pass  # the egress was closed, and this connection with it

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handshake(sock: socket.socket, deadline: float, clock: Clock, secret: bytes | None
               ) -> tuple[tuple[bytes, ...], Rate | None, WelcomeFlags, int, int]:
    """HELLO -> [CHALLENGE -> PROOF ->] WELCOME; see :mod:`lynx_transport.protocol.auth`."""
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
                if not auth.verify(auth.receiver_mac(secret, nonce_s, nonce_r), mac_r):
                    raise AuthenticationError("the receiver failed to prove the shared secret "
                                              "(wrong secret, or not a Lynx receiver)")
                proved = True
                sock.sendall(encode_frame(FrameType.PROOF, auth.sender_mac(secret, nonce_r, nonce_s)))
                continue
            if frame.type is FrameType.HEARTBEAT:  # a sign of life, never an error
                continue
            if frame.type is not FrameType.WELCOME:
                raise ConnectError(f"expected WELCOME from the receiver, got {frame.type.name}")
            if secret is not None and not proved:
                # never hand an unauthenticated worker address to UCX
                raise AuthenticationError("the receiver did not authenticate (it has no shared "
                                          "secret configured); refusing its worker address")
            addresses, gbps, burst, wflags, conn_key, max_open = unpack_welcome(frame.payload)
            return addresses, (Rate(gbps, burst) if gbps > 0 else None), wflags, conn_key, max_open


def open_control(address: tuple[str, int], timeout: float) -> socket.socket:
    """The TCP control connection to a receiver (``ConnectError`` if nobody listens)."""
    try:
        return socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc


def attach(loop: SenderLoop, sock: socket.socket, address: tuple[str, int], timeout: float,
           config: TransportConfig, clock: Clock, *, owns_loop: bool) -> Connection:
    """Handshake on ``sock`` (this thread), then hand it to ``loop`` as a new peer.

    ``owns_loop``: the loop is the connection's own and not started yet (it is
    started here): the connection's shaping starts from ``config``'s rates.
    Otherwise the loop is a shared egress's, running; its peers start unshaped.
    Closes ``sock`` on failure.
    """
    try:
        deadline = clock.now() + timeout
        ucx_addresses, peer_rate, wflags, conn_key, max_open = _handshake(sock, deadline, clock,
                                                                          config.secret)
        shaper = (Shaper(clock, config.link_rate, dict(config.lane_rates)) if owns_loop
                  else Shaper(clock))
        shaper.set_peer_rate(peer_rate)
        chunk_sums = bool(wflags & WelcomeFlags.CHUNK_SUMS)

        def add() -> Peer:
            return loop.add_peer(sock, ucx_addresses, shaper, chunk_sums, conn_key, max_open)

        peer = add() if owns_loop else loop.run(add, timeout)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, (OSError, ProtocolError)):
            raise ConnectError(f"handshake with {address[0]}:{address[1]} failed: {exc}") from exc
        raise
    if owns_loop:
        loop.start()
    return Connection(loop, peer, config, clock, owns_loop)


def connect(address: tuple[str, int], *, timeout: float = 5.0,
            config: TransportConfig | None = None, clock: Clock | None = None) -> Connection:
    """Connect to a :class:`~lynx_transport.ucx.receiver.Receiver` at ``(host, port)``.

    The connection gets an egress of its own (one I/O thread and UCX worker,
    stopped by :meth:`Connection.close`); ``config.link_rate``/``lane_rates``
    shape it. ``timeout`` bounds the TCP connect and, again, the handshake; UCX
    starts in between (slow the first time in a process). Raises
    :class:`ConnectError` if nobody listens, the handshake fails, or either step
    does not finish within ``timeout`` seconds; :class:`AuthenticationError`
    (a ``ConnectError``) when ``config.secret`` and the receiver's disagree.
    """
    config = config if config is not None else TransportConfig()
    clock = clock if clock is not None else MonotonicClock()
    sock = open_control(address, timeout)
    # UCX starts before HELLO: a process's first UCX context is slow to create, and
    # once it has sent WELCOME the receiver counts silence
    try:
        worker = UcxWorker(config.ucx_tls, config.ucx_net_devices or "all")
    except BaseException:
        sock.close()
        raise
    try:
        loop = SenderLoop(config, clock, worker)
    except BaseException:
        sock.close()
        worker.close()
        raise
    try:
        return attach(loop, sock, address, timeout, config, clock, owns_loop=True)
    except BaseException:
        loop.discard()
        raise
