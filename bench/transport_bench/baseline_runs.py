"""The baselines' runners in ``lynx bench-transport``: raw ucxx, asyncio TCP and ``ucx_perftest``.

Each is a :class:`~lynx_bench.transport_bench.runner.Runner` over a connection that
:mod:`lynx_bench.transport_bench.baselines` opened (the owner,
:class:`~lynx_bench.transport_bench.backends.Backends`, starts and stops it):

* :class:`UcxxThroughput` - raw ucxx tagged messages from an untouched or a written buffer;
* :class:`AsyncioTcpThroughput` - plain asyncio TCP messages (a written buffer);
* :class:`UcxPerftest` - one ``ucx_perftest -t tag_bw`` run, its own two processes;
* :class:`UcxPerftestLatency` - one ``ucx_perftest -t tag_lat`` run per message size.

Every group of timed messages (and ``ucx_perftest``'s timed iterations) follows
``WARM_UP_S`` of the same sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx_bench.transport_bench.baselines import (
    RawUcxxSender,
    TcpSender,
    ucx_perftest_gbps,
    ucx_perftest_latency_us,
)
from lynx_bench.transport_bench.peers.engines import WARM_UP_S, timed
from lynx_bench.transport_bench.runner import Plan, Record

__all__ = ["AsyncioTcpThroughput", "UcxPerftest", "UcxPerftestLatency", "UcxxThroughput"]


@dataclasses.dataclass(frozen=True)
class UcxxThroughput:
    """``name``'s throughput: ``plan.messages`` raw ucxx messages to the receiver child ``peer``
    from the ``seed`` buffer (:func:`lynx_transport.testing.pattern`)."""

    name: str
    sender: RawUcxxSender
    peer: Any
    seed: int
    phase: str = "throughput"

    def run(self, plan: Plan) -> Record:
        got = timed(lambda: self.sender.send(self.peer, self.seed), plan.messages, WARM_UP_S)
        return Record(throughput_s={self.name: got})


@dataclasses.dataclass(frozen=True)
class AsyncioTcpThroughput:
    """``asyncio_tcp``'s throughput: ``plan.messages`` messages over a plain TCP socket."""

    sender: TcpSender
    phase: str = "throughput"

    def run(self, plan: Plan) -> Record:
        return Record(throughput_s={"asyncio_tcp": timed(self.sender.send, plan.messages, WARM_UP_S)})


@dataclasses.dataclass(frozen=True)
class UcxPerftest:
    """One ``ucx_perftest`` run of ``2 * max(plan.messages, 5)`` timed iterations on the
    default UCX path (or ``tls``, ``UCX_TLS=tcp`` beside ``lynx_tcp``), after the others'
    warm-up: ``WARM_UP_S`` of sends at ~10 GB/s."""

    tls: str | None = None
    phase: str = "throughput"

    def run(self, plan: Plan) -> Record:
        warmup = max(1, round(WARM_UP_S * 10e9 / plan.nbytes))
        gbps = ucx_perftest_gbps(plan.nbytes, max(plan.messages, 5) * 2, self.tls or plan.tls,
                                 warmup=warmup)
        return Record(perftest_tcp_gbps=[gbps]) if self.tls else Record(perftest_gbps=[gbps])


@dataclasses.dataclass(frozen=True)
class UcxPerftestLatency:
    """One ``ucx_perftest -t tag_lat`` run at ``size``: ``plan.latency_messages`` ping-pongs
    after as many untimed ones; its 50th percentile of half a round trip (the physical limit
    of one tagged message on the default UCX path)."""

    size: int
    phase: str = "latency"

    def run(self, plan: Plan) -> Record:
        n = max(plan.latency_messages, 5)
        us = ucx_perftest_latency_us(self.size, n, plan.tls, warmup=n)
        return Record(perftest_latency_us={self.size: [us]})
