"""One send scheduler per sending node, shared by all its connections.

Usage (a prefill node serving several decode nodes)::

    with Egress(config) as egress:
        egress.set_link_rate(Rate(gbps=10))             # the node's egress, all peers together
        a = egress.connect(decode_a, timeout=5)         # a Connection, as from connect()
        b = egress.connect(decode_b, timeout=5)
        sa = a.send_stream([("k", k_anchor, Lane.ANCHOR), ("r", res, Lane.RESIDUAL)])
        sb = b.send_stream([("k", k_anchor2, Lane.ANCHOR)])  # overtakes a's residual

Threads: an egress has one I/O thread (``lynx-tx-io``, :mod:`lynx_transport.ucx.sender_loop`)
with one UCX worker, one :class:`~lynx_transport.protocol.scheduler.PriorityScheduler`
and one egress :class:`~lynx_transport.protocol.shaper.Shaper` for every connection
made through it. Lane priority therefore holds across every stream and every
peer: no residual chunk for any peer leaves while an anchor chunk for any peer
is ready (within the one bytes-in-flight bound, ``max_inflight_bytes``, of the
whole egress); within a lane, ``TransportConfig.lane_policy`` orders the
streams. Each connection keeps a shaper of its own - its cap
(``Connection.set_link_rate``), the rate its receiver asks for, its lane
rates - and a peer over its own cap does not hold back the others (work
conserving). Methods may be called from any thread; each hands its work to the
I/O thread and waits at most its timeout for the hand-off.

Failures: a broken connection (its receiver died, closed or went silent past
``peer_timeout_s``) fails only its own streams; the egress keeps serving the
others and frees the dead peer's state (its endpoints, streams and scheduler
entries; :meth:`Egress.peers` no longer lists it). :meth:`Egress.close` closes
every connection it made (their streams fail with ``ClosedError``).

``connect(address)`` is the one-receiver case: a connection with an egress of
its own, closed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lynx_transport.config import TransportConfig
from lynx_transport.errors import ClosedError
from lynx_transport.lanes import check_lane
from lynx_transport.protocol.clock import Clock, MonotonicClock
from lynx_transport.protocol.shaper import Rate
from lynx_transport.stats import TransportStats
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.connection import Connection, attach, open_control
from lynx_transport.ucx.sender_loop import SenderLoop

__all__ = ["Egress"]


class Egress:
    """A sending node's egress: one I/O thread, scheduler and shaper for all its connections.

    ``config`` applies to every connection made through it; its ``link_rate``
    and ``lane_rates`` shape the egress as a whole. Starts UCX at once (slow
    the first time in a process). See the module docstring.
    """

    def __init__(self, config: TransportConfig | None = None, *, clock: Clock | None = None) -> None:
        self.config = config if config is not None else TransportConfig()
        self.clock = clock if clock is not None else MonotonicClock()
        worker = UcxWorker(self.config.ucx_tls, self.config.ucx_net_devices or "all")
        try:
            self._loop = SenderLoop(self.config, self.clock, worker, self.config.link_rate,
                                    dict(self.config.lane_rates))
        except BaseException:
            worker.close()
            raise
        self._closed = False
        self._loop.start()

    def _call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        if self._closed:
            raise ClosedError("the egress is closed")
        return self._loop.run(fn, timeout)

    def connect(self, address: tuple[str, int], *, timeout: float = 5.0) -> Connection:
        """Connect to a receiver at ``(host, port)``: the handshake of
        :func:`~lynx_transport.ucx.connection.connect` (on the calling thread), then
        the connection joins this egress. ``timeout`` bounds the TCP connect and,
        again, the handshake. Raises like ``connect`` (``ConnectError``,
        ``AuthenticationError``), and ``ClosedError`` once the egress is closed."""
        if self._closed:
            raise ClosedError("the egress is closed")
        sock = open_control(address, timeout)
        return attach(self._loop, sock, address, timeout, self.config, self.clock, owns_loop=False)

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape the node's egress: one rate for all peers together (at once, also
        mid-stream); ``None``: unshaped. Per-peer caps: ``Connection.set_link_rate``."""
        self._call(lambda: self._loop.shaper.set_link_rate(rate))

    def set_lane_rate(self, lane: int, rate: Rate | None) -> None:
        """Shape one lane of the egress, all peers together (a lane over its rate does
        not hold back lower lanes)."""
        lane = check_lane(lane)
        self._call(lambda: self._loop.shaper.set_lane_rate(lane, rate))

    def rates(self) -> dict[str, Rate | None]:
        """The egress's shaping: ``link`` and lanes (``lane0``, ...)."""
        rates = self._call(self._loop.shaper.rates)
        del rates["peer"]  # a receiver's requested cap is per connection (Connection.rates)
        return rates

    def stats(self) -> TransportStats:
        """All connections together: per-lane bytes sent, achieved rates, queued and
        in-flight bytes; streams active (on live connections), completed, failed."""
        return self._call(self._loop.stats)

    def peers(self) -> list[tuple[str, int]]:
        """``(host, port)`` of each live connection, oldest first (a broken or closed
        one is gone, and so is its state)."""
        return self._call(self._loop.peer_addresses)

    def close(self, timeout: float = 5.0) -> None:
        """Close every connection (their active streams fail with ``ClosedError``,
        each receiver is told goodbye), stop the I/O thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.stop(timeout)

    def __enter__(self) -> Egress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
