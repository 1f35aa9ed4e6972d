"""lynx_transport: bytes only. UCX endpoints, a pre-registered receive pool,
priority lanes, bandwidth shaping and completion callbacks.

Knows nothing about KV caches, models or quantization.

Receiver (decode node)::

    pool = ReceivePool(1 << 30)
    with Receiver(pool, on_lane_complete=lambda s, lane: ...) as rx:
        stream = rx.next_stream(timeout=10)       # manifest + metadata, before data
        stream.wait_lane(Lane.ANCHOR, timeout=5)
        anchor = stream.view("k_anchor")          # NumPy/CuPy view into the pool

Sender (prefill node)::

    with connect(rx_address, timeout=5) as conn:
        s = conn.send_stream([("k_anchor", a, Lane.ANCHOR), ("k_res", r, Lane.RESIDUAL)],
                             metadata=b"...")
        s.wait(timeout=30)                        # confirmed by the receiver

A sender with several receivers shares one ``Egress`` (one scheduler, so lane
priority and the node's link rate hold across all of them)::

    with Egress(config) as egress:
        a, b = egress.connect(rx_a, timeout=5), egress.connect(rx_b, timeout=5)

Threads and futures: each Receiver and each Egress (a Connection from
``connect`` has one of its own) runs one I/O thread that owns its UCX worker;
receiver callbacks run on one callback thread. Every blocking call takes a
timeout. Errors: :mod:`lynx_transport.errors`.

Layout: the API at the top (this module, :mod:`~lynx_transport.seam`, the stream
handles, config, errors, lanes, stats, :mod:`~lynx_transport.testing`);
:mod:`lynx_transport.protocol` the pure logic both transports share,
:mod:`lynx_transport.ucx` the real transport, :mod:`lynx_transport.memory` the
in-memory twin. Importing this package never imports ucxx: the first UCX start does.
"""

from lynx_transport.config import TransportConfig
from lynx_transport.errors import LynxError, TransportError
from lynx_transport.lanes import Lane
from lynx_transport.protocol.pool import PoolMemory, ReceivePool
from lynx_transport.protocol.scheduler import LanePolicy
from lynx_transport.protocol.shaper import Rate
from lynx_transport.receive_stream import ReceivedRegion, ReceiveStream
from lynx_transport.send_stream import SendStream
from lynx_transport.state import StreamState
from lynx_transport.stats import LaneStats, TransportStats
from lynx_transport.ucx.connection import Connection, connect
from lynx_transport.ucx.egress import Egress
from lynx_transport.ucx.receiver import Receiver
from lynx_transport.ucx.transport import UCX

__all__ = [
    "UCX",
    "Connection",
    "Egress",
    "Lane",
    "LanePolicy",
    "LaneStats",
    "LynxError",
    "PoolMemory",
    "Rate",
    "ReceivePool",
    "ReceiveStream",
    "ReceivedRegion",
    "Receiver",
    "SendStream",
    "StreamState",
    "TransportConfig",
    "TransportError",
    "TransportStats",
    "connect",
]
