"""Every backend of ``lynx bench-transport``, started once, and one round's runners in order.

:class:`Backends` owns the processes: Lynx's two paths
(:class:`~lynx_bench.transport_bench.lynx_runs.LynxPaths`), the raw ucxx and the
asyncio TCP receivers with their senders
(:mod:`lynx_bench.transport_bench.baselines`), and the peer engines
(:class:`~lynx_bench.transport_bench.peer_runs.PeerBackends`, whose processes
live for one round each). :meth:`Backends.runners` is the interleaving of one
round, the same every round:

1. throughput: ``lynx``, ``ucxx``, ``lynx_written``, ``ucxx_written`` (each Lynx
   group right before the raw ucxx group from the same buffer), ``asyncio_tcp``,
   ``ucx_perftest``, ``lynx_tcp``, ``ucx_perftest`` over tcp;
2. latency: per size of :data:`~lynx_bench.transport_bench.runner.LATENCY_SIZES`,
   ``lynx`` then ``lynx_tcp`` (each also timing its one-way ``*_oneway`` entry), then
   ``ucx_perftest``'s ``tag_lat``;
3. each peer backend still able to run, in :meth:`PeerBackends.names` order.
"""

from __future__ import annotations

from lynx_bench.transport_bench import baselines as base
from lynx_bench.transport_bench.baseline_runs import (
    AsyncioTcpThroughput,
    UcxPerftest,
    UcxPerftestLatency,
    UcxxThroughput,
)
from lynx_bench.transport_bench.lynx_runs import LynxLatency, LynxPaths, LynxThroughput
from lynx_bench.transport_bench.peer_runs import TCP_TLS, PeerBackends, PeerRun
from lynx_bench.transport_bench.peers.engines import Engine
from lynx_bench.transport_bench.runner import LATENCY_SIZES, Plan, Runner
from lynx_transport import TransportConfig
from lynx_transport.testing import UNTOUCHED, WRITTEN_ZEROS, PeerProcess

__all__ = ["Backends"]

#: The throughput runs' send buffers: the JSON name's suffix -> the buffer's seed.
SOURCES = {"": UNTOUCHED, "_written": WRITTEN_ZEROS}


class Backends:
    """The backends of a run of ``plan`` with Lynx's ``config``, the shaping run's ``rates``
    and the peer engines ``selected``; ``ucx_env`` as for :class:`PeerBackends`. The
    processes start here; :meth:`start` connects them, :meth:`close` stops them."""

    def __init__(self, plan: Plan, config: TransportConfig, rates: list[float],
                 selected: list[Engine], ucx_env: dict[str, str]) -> None:
        self.plan = plan
        self.selected = selected
        self.ucx_env = ucx_env
        self.lynx = LynxPaths(config, plan.nbytes, rates)
        self.ucxx_peer = PeerProcess(base.raw_ucxx_receiver, plan.nbytes, plan.tls)
        self.tcp_peer = PeerProcess(base.tcp_receiver, plan.nbytes)
        self.raw: base.RawUcxxSender | None = None
        self.tcp: base.TcpSender | None = None
        self.peers: PeerBackends | None = None

    def start(self) -> None:
        """Wait for every child, connect the baselines' senders, find the peer engines."""
        plan = self.plan
        self.lynx.connect()
        self.raw = base.raw_ucxx_send(self.ucxx_peer.reply(60), plan.nbytes, plan.tls)
        self.tcp = base.tcp_send(tuple(self.tcp_peer.reply(60)), plan.nbytes)
        self.peers = PeerBackends(self.selected, plan.nbytes, plan.tls, self.ucx_env)

    def runners(self) -> list[Runner]:
        """One round's runners, in the order they run (see the module docstring)."""
        assert self.raw is not None and self.tcp is not None and self.peers is not None, "start() first"
        lynx, lynx_tcp = self.lynx.peers["lynx"], self.lynx.peers["lynx_tcp"]
        runners: list[Runner] = []
        for suffix, seed in SOURCES.items():
            runners += [LynxThroughput("lynx" + suffix, lynx, seed, end_to_end=not suffix),
                        UcxxThroughput("ucxx" + suffix, self.raw, self.ucxx_peer, seed)]
        runners += [AsyncioTcpThroughput(self.tcp), UcxPerftest(),
                    LynxThroughput("lynx_tcp", lynx_tcp, UNTOUCHED), UcxPerftest(TCP_TLS)]
        for size in LATENCY_SIZES:
            runners += [LynxLatency(name, peer, size, self.lynx.landed[name])
                        for name, peer in self.lynx.peers.items()]
            runners.append(UcxPerftestLatency(size))
        runners += [PeerRun(name, self.peers) for name in self.peers.names()]
        return runners

    def stop_tcp(self) -> None:
        """Close the asyncio TCP sender's socket (after the last round)."""
        if self.tcp is not None:
            self.tcp.close()

    def close(self) -> None:
        """Stop every child process and close Lynx's receivers."""
        for process in (self.ucxx_peer, self.tcp_peer):
            process.close()
        self.lynx.close()
