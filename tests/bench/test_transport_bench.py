"""Transport micro-benchmarks (``make bench``), each next to a baseline measured in the same run.

* scheduler/shaper/wire: the per-chunk and per-manifest cost of Lynx's pure
  logic, against a bare ``deque`` pop (the floor for handing out work);
* loopback: one 64 MiB stream through Lynx against the same message through
  raw ucxx on the same UCX path, and against a NumPy memcpy of 64 MiB.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from lynx_transport import Lane, Rate, ReceivePool, Receiver, TransportConfig
from lynx_transport.protocol.clock import MonotonicClock
from lynx_transport.protocol.manifest import Manifest, ManifestLimits, RegionSpec, decode_manifest, encode_manifest
from lynx_transport.protocol.scheduler import PriorityScheduler
from lynx_transport.protocol.shaper import Shaper
from lynx_transport.testing import WRITTEN_ZEROS, PeerProcess, sender_server

pytestmark = pytest.mark.bench

CHUNKS = 10_000
MiB = 1 << 20


def test_baseline_deque_pop(benchmark) -> None:
    def run() -> int:
        q = collections.deque(range(CHUNKS))
        n = 0
        while q:
            n += q.popleft()
        return n
    assert benchmark(run) == sum(range(CHUNKS))


def test_scheduler_chunk_decisions(benchmark) -> None:
    def run() -> int:
        clock = MonotonicClock()
        sched = PriorityScheduler(clock, chunk_bytes=4096, max_inflight_bytes=1 << 30,
                                  shaper=Shaper(clock, link=Rate(1e5, 1 << 30)))
        sched.add_region(1, 0, Lane.RESIDUAL, 4096 * CHUNKS // 2, 0)
        sched.add_region(1, 1, Lane.ANCHOR, 4096 * CHUNKS // 2, CHUNKS // 2)
        n = 0
        while (chunk := sched.next_chunk()) is not None:
            sched.complete(chunk)
            n += 1
        return n
    assert benchmark(run) == CHUNKS


def test_manifest_round_trip_1000_regions(benchmark) -> None:
    limits = ManifestLimits()
    m = Manifest(1, 1 << 20, tuple(RegionSpec(f"layer{i}.k", 1 << 16, i % 2) for i in range(1000)),
                 b"x" * 1024)
    assert benchmark(lambda: decode_manifest(encode_manifest(m, limits), limits)) == m


def test_baseline_memcpy_64mib(benchmark) -> None:
    src = np.full(64 * MiB, 1, np.uint8)
    dst = np.empty_like(src)
    benchmark(np.copyto, dst, src)
    assert dst[-1] == 1


@pytest.fixture(scope="module")
def loopback():
    config = TransportConfig()
    pool = ReceivePool(256 * MiB)
    rx = Receiver(pool, config=config, on_stream_complete=lambda s: s.release())
    peer = PeerProcess(sender_server, rx.address, config)
    try:
        assert peer.reply(60) == "connected"
        yield peer
    finally:
        peer.close()
        rx.close()


def test_lynx_stream_64mib_loopback(benchmark, loopback) -> None:
    peer = loopback
    specs = [("msg", 64 * MiB, Lane.RESIDUAL, WRITTEN_ZEROS)]
    result = benchmark.pedantic(lambda: peer.call("send", specs, b"", 60.0), rounds=8,
                                warmup_rounds=1)
    assert result["state"] == "completed"


@pytest.fixture(scope="module")
def raw_ucxx():
    from lynx_bench.transport_bench import baselines as base

    tls = TransportConfig().ucx_tls  # the same UCX path as Lynx
    peer = PeerProcess(base.raw_ucxx_receiver, 64 * MiB, tls)
    try:
        yield peer, base.raw_ucxx_send(peer.reply(60), 64 * MiB, tls)
    finally:
        peer.close()


def test_baseline_raw_ucxx_64mib_loopback(benchmark, raw_ucxx) -> None:
    peer, sender = raw_ucxx
    seconds = benchmark.pedantic(lambda: sender.send(peer, WRITTEN_ZEROS), rounds=8,
                                 warmup_rounds=1)
    assert seconds > 0
