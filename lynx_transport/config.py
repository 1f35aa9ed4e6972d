"""Transport configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses

from lynx_transport.lanes import check_lane
from lynx_transport.protocol.manifest import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, ManifestLimits
from lynx_transport.protocol.scheduler import LanePolicy
from lynx_transport.protocol.shaper import Rate
from lynx_transport.protocol.wire import MAX_RAILS

__all__ = ["TransportConfig", "MIN_SECRET_BYTES"]

#: Shortest shared secret accepted (bytes).
MIN_SECRET_BYTES = 16


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Settings shared by senders and receivers; validated on construction.

    Sizes are bytes, times seconds, rates :class:`Rate`. A value out of the
    range given below raises ``ValueError``.

    chunk_bytes:
        Chunk size regions are cut into, in ``[MIN_CHUNK_BYTES,
        MAX_CHUNK_BYTES]`` (default 1 MiB); also the granularity at which a
        shaped link interleaves lanes. Smaller chunks lower anchor latency
        under load, larger ones cost less per byte.
    max_inflight_bytes:
        Most bytes handed to UCX and not yet completed per sending egress (all
        connections of one :class:`~lynx_transport.ucx.egress.Egress` together; a
        connection from ``connect`` has an egress of its own); >= 1, default
        32 MiB. The most an anchor chunk can wait behind. Receive rails confirm
        chunks in batches, so it should cover several chunks per rail. Lower it
        for tighter anchor latency on slow unshaped links; a shaped link holds
        it to the shaper's burst anyway.
    heartbeat_interval_s / peer_timeout_s:
        A side silent for ``heartbeat_interval_s`` (default 0.25) sends a
        heartbeat, from a thread that does nothing else; a peer with no sign of
        life (a frame, a byte waiting in the control socket, a data chunk
        landing) for ``peer_timeout_s`` (default 30) is lost
        (``PeerDisconnectedError``). Needs ``0 < heartbeat_interval_s <
        peer_timeout_s``. The limit catches a hung peer or a partitioned link
        only: a dead process is noticed at once (closed connection, UCX
        endpoint error). Keep it well above what a CPU-starved but healthy
        process goes quiet for.
    ucx_tls:
        UCX transports (``UCX_TLS`` syntax, non-empty), given to the UCX
        context, never written to the environment. Default ``"^posix,sysv"``:
        all but UCX's shared-memory FIFOs, which were unstable when a sender
        died mid-transfer; on one host bulk data then moves by ``cma``
        single-copy reads, which need ptrace permission between the processes
        (same user; ``kernel.yama.ptrace_scope`` <= 1). A receiver bound to a
        loopback address also limits UCX to ``NET_DEVICES=lo``.
    ucx_net_devices:
        UCX network devices (``UCX_NET_DEVICES`` syntax, e.g. ``"veth0"``),
        non-empty, given to the UCX context like ``ucx_tls``. ``None``
        (default): ``lo`` for a receiver bound to a loopback address, else
        every device. Pin it (with ``ucx_tls="tcp"``) to keep data on one
        interface, e.g. an emulated link.
    link_rate / lane_rates:
        Initial sender-side shaping (default none; ``lane_rates`` pairs a lane
        with a :class:`Rate`). For an ``Egress``, one rate for all its peers
        together (``Egress.set_link_rate`` / ``set_lane_rate``); for a
        connection from ``connect``, that connection
        (``Connection.set_link_rate`` / ``set_lane_rate``).
    lane_policy:
        Sender side: which stream goes next within one lane, across every
        stream of every connection of an egress (:class:`LanePolicy`: ``FIFO``
        by arrival, the default and best at the P99 time to first token;
        ``SRF`` shortest remaining first; ``DRR`` deficit round-robin, a
        one-chunk quantum). Lanes keep strict priority whatever the policy.
    manifest_limits:
        What a receiver accepts (and what a sender checks before sending).
    pool_wait_s:
        A stream that does not fit in the receive pool waits up to this long
        (>= 0, default 2) for space before it is rejected
        (``PoolExhaustedError`` at the sender); 0 rejects at once.
    secret:
        Optional shared secret (bytes, at least :data:`MIN_SECRET_BYTES`;
        default ``None``). When set, the handshake is a mutual HMAC-SHA256
        challenge-response (:mod:`lynx_transport.protocol.auth`): a receiver refuses
        (``DENIED``, logged with the peer address) a sender without it before
        exposing its UCX worker address or any pool memory, and a sender
        refuses (``AuthenticationError``) a receiver that cannot prove it.
        Never in ``repr`` or any log line.
    handshake_timeout_s:
        A receiver drops a connection that has not finished the handshake
        (HELLO, and PROOF when a secret is set) within this time (> 0,
        default 5).
    verify_chunks:
        Receiver side (default off): ask senders for a CRC32 of every chunk
        (``CHUNK_SUM``) and count a chunk as landed only when the pool bytes
        match it; UCX does not report a tagged receive's length, so without it
        a short chunk leaves stale pool bytes counted as landed. Costs a CRC32
        of every byte on both sides (device chunks are copied to host for it).
    thread_nice:
        Added to the niceness of the transport's I/O and callback threads when
        they start, like ``nice -n``; an int in ``[-39, 39]``, default 0 (left
        alone). Positive values need no privilege and yield the CPU to other
        threads at the cost of transport latency (on the critical path when
        the first model step overlaps the transfer, so the decode node keeps
        0); negative values need ``CAP_SYS_NICE``.
    rails:
        Receiver side: UCX workers a stream's chunks are spread over (chunk
        ``i`` on rail ``i % rails``), each progressed by its own thread (the
        I/O thread runs rail 0); an int in ``[1, MAX_RAILS]``, default 2. Over
        ``cma`` the receiver's progress does the copy, so two rails copy on two
        cores. Senders make one endpoint per rail (listed in WELCOME).
    send_before_accept:
        Sender side (default on): a stream's chunks leave right behind its
        manifest (``OPEN_SENT``), with no wait for the receiver's ACCEPT, to a
        receiver that takes that (every wire-2 receiver, for manifests up to its
        limit). They wait in UCX until the receiver has carved its pool and
        posted their receives. A stream that waits for pool space
        (``pool_wait_s``) holds its chunks in the sender's in-flight window
        meanwhile. Off: every stream waits for its ACCEPT, one control round trip
        before the first byte.
    busy_poll:
        Latency mode (default off). The sender's and the receiver's I/O threads
        never sleep: they poll UCX, their control sockets and their callers'
        requests in a loop, yielding the core between rounds, instead of
        sleeping on UCX's event fd when idle. A frame or a completion is seen
        at the next round, not after a thread wake-up. Costs a whole core per
        I/O thread (one per sender egress, one per receiver) for as long as
        the transport is open, idle or not. The receiver's extra rails
        (``rails`` > 1) keep the adaptive loop; ``rails=1`` puts every chunk
        on the polling thread. For hosts with cores to spare (a decode node
        whose model runs on a GPU); off where the model shares the CPU.
    send_from_caller:
        Sender side (default on). When the sender's I/O thread is waiting
        (asleep, or between polls), a call such as ``send_stream`` runs on the
        caller's own thread, which also hands the stream's first chunks to UCX,
        instead of queueing the call and waking the I/O thread; the I/O thread
        is woken after, to watch the sends. Off: every call goes through the
        I/O thread (one thread hand-off before the first byte).

    The measurements behind these defaults: docs/design.md, "Measured facts".
    """

    chunk_bytes: int = 1 << 20
    max_inflight_bytes: int = 32 << 20
    heartbeat_interval_s: float = 0.25
    peer_timeout_s: float = 30.0
    ucx_tls: str = "^posix,sysv"
    ucx_net_devices: str | None = None
    link_rate: Rate | None = None
    lane_rates: tuple[tuple[int, Rate], ...] = ()
    lane_policy: LanePolicy = LanePolicy.FIFO
    manifest_limits: ManifestLimits = ManifestLimits()
    pool_wait_s: float = 2.0
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    handshake_timeout_s: float = 5.0
    verify_chunks: bool = False
    thread_nice: int = 0
    rails: int = 2
    send_before_accept: bool = True
    busy_poll: bool = False
    send_from_caller: bool = True

    def __post_init__(self) -> None:
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                             f"got {self.chunk_bytes}")
        if self.max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be >= 1, got {self.max_inflight_bytes}")
        if not 0 < self.heartbeat_interval_s < self.peer_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < peer_timeout_s, got "
                             f"{self.heartbeat_interval_s} and {self.peer_timeout_s}")
        if self.pool_wait_s < 0:
            raise ValueError(f"pool_wait_s must be >= 0, got {self.pool_wait_s}")
        if self.secret is not None and (not isinstance(self.secret, bytes)
                                        or len(self.secret) < MIN_SECRET_BYTES):
            raise ValueError(f"secret must be bytes of length >= {MIN_SECRET_BYTES}")
        if self.handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if self.ucx_net_devices is not None and not self.ucx_net_devices:
            raise ValueError("ucx_net_devices must be None or a non-empty device list")
        if not isinstance(self.thread_nice, int) or not -39 <= self.thread_nice <= 39:
            raise ValueError(f"thread_nice must be an int in [-39, 39], got {self.thread_nice!r}")
        if not isinstance(self.rails, int) or not 1 <= self.rails <= MAX_RAILS:
            raise ValueError(f"rails must be an int in [1, {MAX_RAILS}], got {self.rails!r}")
        for name in ("busy_poll", "send_before_accept", "send_from_caller"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.lane_policy, LanePolicy):
            raise ValueError(f"lane_policy must be a LanePolicy, got {self.lane_policy!r}")
        if not self.ucx_tls:
            raise ValueError("ucx_tls must not be empty")
        for lane, rate in self.lane_rates:
            check_lane(lane)
            if not isinstance(rate, Rate):
                raise ValueError(f"lane_rates values must be Rate, got {rate!r}")
