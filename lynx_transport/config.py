"""Transport configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

import dataclasses

from lynx_transport.lanes import check_lane
from lynx_transport.manifest import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, ManifestLimits
from lynx_transport.scheduler import LanePolicy
from lynx_transport.shaper import Rate
from lynx_transport.wire import MAX_RAILS

__all__ = ["TransportConfig", "MIN_SECRET_BYTES"]

#: Shortest shared secret accepted (bytes).
MIN_SECRET_BYTES = 16


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Settings shared by senders and receivers.

    chunk_bytes:
        Regions are cut into chunks of this size; an anchor chunk waits behind at
        most ``max_inflight_bytes`` of residual, and a shaped link interleaves
        lanes at this granularity. Smaller chunks lower anchor latency under
        load, larger ones cost less per byte.
    max_inflight_bytes:
        Bytes handed to UCX and not yet completed, per sending egress (all the
        connections of one :class:`~lynx_transport.egress.Egress` together; a
        connection from ``connect`` has an egress of its own): the most an
        anchor chunk can wait behind. A receive rail takes the chunks it has
        been told of in one batch and confirms them together, so the window
        drains and refills in bursts; 32 MiB (16 MiB per rail) keeps both rails
        busy on 64 MiB loopback streams (measured here, 1 MiB chunks, 2 rails,
        interleaved: 67-78 Gbit/s with 16 MiB in flight, 83-109 with 32). Lower
        it for tighter anchor latency on slow unshaped links (32 MiB is 27 ms at
        10 Gbit/s); a shaped link holds it to the shaper's burst anyway.
    heartbeat_interval_s / peer_timeout_s:
        Each side sends a heartbeat when it has been silent for
        ``heartbeat_interval_s``, from a thread that does nothing else, and
        declares the peer lost (``PeerDisconnectedError``) after no sign of life
        from it (a frame, a byte waiting in the control socket, a data chunk
        landing) for ``peer_timeout_s``. That limit only catches a hung peer or
        a partitioned link; a peer whose process died is noticed at once, by its
        closed connection or a UCX endpoint error, whatever the limit. The
        default of 30 s is far above what a busy but healthy process goes quiet
        for (a CPU-starved node on a loaded host).
    ucx_tls:
        UCX transports (``UCX_TLS`` syntax), given to the UCX context (never
        written to the environment). The default is everything except UCX's
        shared-memory FIFOs (``posix``, ``sysv``): on one host the bulk data
        then moves by ``cma`` single-copy reads and the small rendezvous
        messages over tcp loopback; across hosts UCX picks rc/ud/tcp as usual.
        Measured here: with ``posix``/``sysv`` enabled a receiver whose sender
        was SIGKILLed mid-transfer segfaulted inside UCX about once in ten runs
        (0 in 22 without them), at no gain in throughput; ``^cma`` (shared-memory
        fragments) needs both sides polling and collapsed under CPU
        contention. ``cma`` needs ptrace permission between the two processes
        (same user; ``kernel.yama.ptrace_scope`` <= 1). A receiver bound to a
        loopback address also limits UCX to ``NET_DEVICES=lo``, so its worker
        is not reachable from other hosts either.
    ucx_net_devices:
        UCX network devices (``UCX_NET_DEVICES`` syntax, e.g. ``"veth0"``), given to
        the UCX context like ``ucx_tls``. ``None`` (default): ``lo`` for a
        receiver bound to a loopback address, else every device. Pin it (with
        ``ucx_tls="tcp"``) to keep data on one interface, e.g. an emulated link.
    link_rate / lane_rates:
        Initial shaping on the sender side. For an ``Egress``, the node's
        egress: one rate for all its peers together (change it with
        ``Egress.set_link_rate`` / ``set_lane_rate``). For a connection from
        ``connect``, that connection (``Connection.set_link_rate`` /
        ``set_lane_rate``).
    lane_policy:
        Sender side: which stream goes next within one lane, across every
        stream of every connection of an egress (:class:`LanePolicy`: ``FIFO``
        by arrival, ``SRF`` shortest remaining first, ``DRR`` deficit
        round-robin with a one-chunk quantum). Lanes keep strict priority
        whatever the policy. FIFO is the default because it gave the best P99
        time to first token (measured with ``lynx load --decode sink --schemes
        int8,lynx --bandwidth 1 --context 4096 --decode-nodes 3 --load 0.8
        --requests 80 --lane-policy P``, one run each, same arrivals): p99
        ttft int8 / lynx FIFO 1.80 / 0.73 s, SRF 3.07 / 0.69 s, DRR 2.52 /
        0.87 s; p99 full cache lynx FIFO 2.70, SRF 4.28, DRR 3.84 s. SRF
        helps the median but starves the big streams at the tail; DRR makes
        every stream on a lane finish late.
    manifest_limits:
        What a receiver accepts (and what a sender checks before sending).
    secret:
        Optional shared secret (bytes, at least 16). When set, the control
        handshake is a mutual HMAC-SHA256 challenge-response (see
        :mod:`lynx_transport._auth`): a receiver refuses (``DENIED``, logged
        with the peer address) a sender without it before exposing its UCX
        worker address or any pool memory, and a sender refuses
        (``AuthenticationError``) a receiver that cannot prove it. Never part
        of ``repr`` or any log line.
    handshake_timeout_s:
        A receiver drops a connection that has not finished the handshake
        (HELLO, and PROOF when a secret is set) within this time.
    verify_chunks:
        Receiver side: ask senders for a CRC32 of every chunk on the control
        channel (``CHUNK_SUM``) and count a chunk as landed only when the
        bytes in the pool match it. UCX does not report how many bytes a
        tagged receive got, so without this a sender that sends a short chunk
        would leave stale pool bytes counted as landed. Costs a CRC32 of
        every byte on both sides (host memory; device chunks are copied).
    thread_nice:
        Added to the niceness of the transport's own threads (the I/O thread
        and the callback thread) when they start, like ``nice -n``; 0 leaves
        them alone. A positive value needs no privilege and lets other
        threads win the CPU on a busy host, at the cost of the transport's
        latency; negative values need ``CAP_SYS_NICE``. Measured on a 2-core
        box (``lynx sweep``, 1 Gbit/s, 4k tokens): +5 on the decode node helped
        the first token when the first model step began after the last anchor
        (0.326 -> 0.316 s), and hurt once the step overlapped the transfer
        (0.238 -> 0.249 s: anchor reception and dequantization are then on
        the critical path), so the decode node keeps 0.
    rails:
        Receiver side: UCX workers a stream's chunks are spread over (chunk
        ``i`` on rail ``i % rails``), each progressed by its own thread (the
        I/O thread runs rail 0). Over ``cma`` the receiver's progress does the
        copy, so two rails copy on two cores; senders make one endpoint per
        rail (the receiver's WELCOME lists them). 1 keeps one thread.
    pool_wait_s:
        Back-pressure: a stream that does not fit in the receive pool waits up
        to this long for released space before it is rejected
        (``PoolExhaustedError`` at the sender); 0 rejects at once.
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
        if not isinstance(self.lane_policy, LanePolicy):
            raise ValueError(f"lane_policy must be a LanePolicy, got {self.lane_policy!r}")
        if not self.ucx_tls:
            raise ValueError("ucx_tls must not be empty")
        for lane, rate in self.lane_rates:
            check_lane(lane)
            if not isinstance(rate, Rate):
                raise ValueError(f"lane_rates values must be Rate, got {rate!r}")
