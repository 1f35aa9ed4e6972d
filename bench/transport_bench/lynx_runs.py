"""Lynx over UCX in ``lynx bench-transport``: its two paths, their runners and the shaped runs.

:class:`LynxPaths` holds Lynx's two paths, each a :class:`~lynx_transport.Receiver`
in this process and a ``sender_server`` child (:mod:`lynx_transport.testing`):
``lynx`` on the default UCX path (``--tls``), ``lynx_tcp`` over ``UCX_TLS=tcp``.
Its runners (:class:`~lynx_bench.transport_bench.runner.Runner`):

* :class:`LynxThroughput` - streams of one region on the residual lane from an
  untouched or a written buffer, timed from the first chunk handed to UCX to the
  receiver's STREAM_DONE (``data_s``; ``total_s`` from ``send_stream()`` on,
  the manifest round trip included, for ``lynx_end_to_end_gbps``);
* :class:`LynxLatency` - streams of one region on the anchor lane, both timings, and the
  one-way time: the sender's ``send_stream()`` call to the receiver's ``on_region``
  callback for that region (both ``time.monotonic()``, one clock for the host's processes).

After the rounds, :meth:`LynxPaths.after_rounds` takes the lanes' statistics and
runs the shaped measurements: :func:`anchor_under_load` and :func:`shaping`.
A stream that does not complete raises ``RuntimeError``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from lynx_bench.transport_bench.peer_runs import TCP_TLS
from lynx_bench.transport_bench.peers.engines import WARM_UP_S, timed
from lynx_bench.transport_bench.runner import Plan, Record
from lynx_transport import Lane, ReceivePool, Receiver, TransportConfig
from lynx_transport.testing import UNTOUCHED, PeerProcess, sender_server

__all__ = ["ANCHOR_BYTES", "LynxAfterRounds", "LynxLatency", "LynxPaths", "LynxThroughput",
           "anchor_under_load", "send_stream", "shaped_bytes", "shaping"]

MiB = 1 << 20
#: The anchor stream of :func:`anchor_under_load`; its residual background is four times as large.
ANCHOR_BYTES = 16 * MiB


def shaped_bytes(gbps: float, chunk: int) -> int:
    """The shaping run's stream at ``gbps``: ~0.8 s at the rate, whole chunks, at least eight."""
    return max(int(gbps * 1e9 / 8 * 0.8) // chunk * chunk, 8 * chunk)


def send_stream(peer: PeerProcess, specs: list[Any]) -> dict[str, Any]:
    """One stream of ``specs`` from the sender child ``peer``; its reply (timings included).
    Raises ``RuntimeError`` when the stream does not complete."""
    res = peer.call("send", specs, b"", 60.0)
    if res["state"] != "completed":
        raise RuntimeError(f"lynx stream failed: {res['error']}")
    return res


@dataclasses.dataclass(frozen=True)
class LynxThroughput:
    """``name``'s throughput: ``plan.messages`` streams of one ``plan.nbytes`` region on the
    residual lane from the ``seed`` buffer (:func:`lynx_transport.testing.pattern`), with the
    end-to-end seconds too when ``end_to_end``."""

    name: str
    peer: PeerProcess
    seed: int
    end_to_end: bool = False
    phase: str = "throughput"

    def run(self, plan: Plan) -> Record:
        specs = [("msg", plan.nbytes, Lane.RESIDUAL, self.seed)]
        got = timed(lambda: send_stream(self.peer, specs), plan.messages, WARM_UP_S)
        return Record(throughput_s={self.name: [res["data_s"] for res in got]},
                      end_to_end_s=[res["total_s"] for res in got] if self.end_to_end else [])


@dataclasses.dataclass(frozen=True)
class LynxLatency:
    """``name``'s latency at ``size``: ``plan.latency_messages`` streams of one untouched region
    on the anchor lane, whole (``latency_s``) and from the first chunk (``data_latency_s``)."""

    name: str
    peer: PeerProcess
    size: int
    landed: dict[int, float]  # stream id -> when its region's callback ran (LynxPaths.landed)
    phase: str = "latency"

    def run(self, plan: Plan) -> Record:
        specs = [("anchor", self.size, Lane.ANCHOR, UNTOUCHED)]
        self.landed.clear()  # the throughput streams' (all finished)
        got = timed(lambda: send_stream(self.peer, specs), plan.latency_messages, WARM_UP_S)
        oneway = [self.callback_at(r["stream_id"]) - r["opened_at"] for r in got]
        return Record(latency_s={self.name: {self.size: [r["total_s"] for r in got]},
                                 f"{self.name}_oneway": {self.size: oneway}},
                      data_latency_s={self.name: {self.size: [r["data_s"] for r in got]}})

    def callback_at(self, stream_id: int) -> float:
        """When the region callback of ``stream_id`` ran (the callback thread may run it
        just after the sender heard STREAM_DONE)."""
        deadline = time.monotonic() + 10.0
        while stream_id not in self.landed:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lynx stream {stream_id}: no region callback")
            time.sleep(1e-4)
        return self.landed.pop(stream_id)


@dataclasses.dataclass(frozen=True)
class LynxAfterRounds:
    """What :meth:`LynxPaths.after_rounds` measured: the default path's lane statistics
    (sender's and receiver's), the anchor-under-load ratios, and per path (``lynx``,
    ``lynx_tcp``) the shaping run per rate (``str(gbps)`` -> achieved Gbit/s and error)."""

    sender_stats: Any
    receiver_stats: Any
    anchor_ratios: list[float]
    shaping: dict[str, dict[str, dict[str, float]]]


def anchor_under_load(peer: PeerProcess, link_gbps: float, chunk: int, runs: int) -> list[float]:
    """``runs`` times an :data:`ANCHOR_BYTES` stream on the anchor lane while a residual stream
    fills a link shaped to ``link_gbps``: its anchor lane's seconds over the ideal
    ``ANCHOR_BYTES / rate``. The link is unshaped again afterwards."""
    rate_bps = link_gbps * 1e9 / 8
    ratios = []
    peer.call("link_rate", (link_gbps, 4 * chunk))
    for _ in range(runs):
        background = peer.call("start", [("res", 4 * ANCHOR_BYTES, Lane.RESIDUAL, -1)], b"")
        # let the residual fill the link (and the in-flight window) first
        time.sleep(0.2)
        res = peer.call("send", [("anc", ANCHOR_BYTES, Lane.ANCHOR, -1)], b"", 60.0)
        if peer.call("wait", background, 60.0)["state"] != "completed" or \
                res["state"] != "completed":
            raise RuntimeError(f"lynx stream under load failed: {res['error']}")
        ratios.append(res["lane_s"][Lane.ANCHOR] / (ANCHOR_BYTES / rate_bps))
    peer.call("link_rate", None)
    return ratios


def shaping(peer: PeerProcess, rates: list[float], chunk: int) -> dict[str, dict[str, float]]:
    """Per rate of ``rates``, one residual stream of :func:`shaped_bytes` through a link shaped
    to it (burst four chunks): ``str(gbps)`` -> achieved Gbit/s and relative error."""
    result = {}
    for gbps in rates:
        burst = 4 * chunk
        shaped = shaped_bytes(gbps, chunk)
        peer.call("link_rate", (gbps, burst))
        res = peer.call("send", [("bulk", shaped, Lane.RESIDUAL, -1)], b"", 60.0)
        peer.call("link_rate", None)
        if res["state"] != "completed":
            raise RuntimeError(f"shaped lynx stream failed: {res['error']}")
        # a bucket lets burst + one chunk go at once, then exactly `rate`
        achieved = (shaped - burst - chunk) * 8 / res["data_s"] / 1e9
        result[str(gbps)] = {"achieved_gbps": round(achieved, 4),
                             "error": round(abs(achieved - gbps) / gbps, 4)}
    return result


class LynxPaths:
    """Lynx's two paths: receivers sized for ``nbytes`` messages and the shaping runs at
    ``rates``, and one sender child each (started here, connected by :meth:`connect`)."""

    def __init__(self, config: TransportConfig, nbytes: int, rates: list[float]) -> None:
        chunk = config.chunk_bytes
        tcp_config = dataclasses.replace(config, ucx_tls=TCP_TLS)
        pool_bytes = max(3 * nbytes, 128 * MiB, *(shaped_bytes(g, chunk) + chunk for g in rates))
        self.config = config
        #: per path, stream id -> time.monotonic() of its (last) region callback
        self.landed: dict[str, dict[int, float]] = {"lynx": {}, "lynx_tcp": {}}

        def on_region(path: str) -> Callable[[Any, Any], None]:
            landed = self.landed[path]
            return lambda stream, _region: landed.__setitem__(stream.stream_id, time.monotonic())

        self.rx = Receiver(ReceivePool(pool_bytes), config=config, on_region=on_region("lynx"),
                           on_stream_complete=lambda s: s.release())
        self.rx_tcp = Receiver(
            ReceivePool(max(nbytes, *(shaped_bytes(g, chunk) + chunk for g in rates)) + 2 * MiB),
            config=tcp_config, on_region=on_region("lynx_tcp"),
            on_stream_complete=lambda s: s.release())
        self.peers = {"lynx": PeerProcess(sender_server, self.rx.address, config),
                      "lynx_tcp": PeerProcess(sender_server, self.rx_tcp.address, tcp_config)}

    def connect(self) -> None:
        """Wait for both senders to connect."""
        for peer in self.peers.values():
            peer.reply(60)

    def after_rounds(self, link_gbps: float, anchor_runs: int, rates: list[float],
                     say: Callable[[str], None]) -> LynxAfterRounds:
        """The lanes' statistics, then :func:`anchor_under_load` (default path) and
        :func:`shaping` on both paths."""
        chunk = self.config.chunk_bytes
        sender_stats = self.peers["lynx"].call("stats")
        receiver_stats = self.rx.stats()
        say("anchor under load")
        ratios = anchor_under_load(self.peers["lynx"], link_gbps, chunk, anchor_runs)
        shaped = {}
        for name, peer in self.peers.items():
            say(f"shaping ({name})")
            shaped[name] = shaping(peer, rates, chunk)
        return LynxAfterRounds(sender_stats, receiver_stats, ratios, shaped)

    def close(self) -> None:
        """Stop the senders, then close the receivers."""
        for peer in self.peers.values():
            peer.close()
        self.rx.close()
        self.rx_tcp.close()
