"""Soak: 1,000 streams of mixed sizes with a fault every ~50 streams (``make soak``).

Faults rotate between: SIGKILL of the sender child mid-stream (then a new
child), a corrupted frame (a raw connection sends a bad manifest and a frame
with a wrong magic), and a cancelled stream. Afterwards the receiver's process
must hold resident memory within 10% of the level after the first 50 streams,
the same open file descriptors and threads, and a fully free pool; after
closing, no lynx thread is left. The figures are printed (``-s``) and attached
to the test report.
"""

from __future__ import annotations

import gc
import os
import random
import struct
import threading

import numpy as np
import psutil
import pytest

from lynx_transport import Lane, ReceivePool, Receiver, StreamState, TransportConfig
from lynx_transport.errors import LynxError
from lynx_transport.protocol.wire import FrameType
from lynx_transport.testing import PeerProcess, RawPeer, pattern, sender_server, wait_until
from lynx_transport.ucx import adapter

pytestmark = [pytest.mark.ucx, pytest.mark.slow]

CONFIG = TransportConfig(chunk_bytes=256 * 1024, max_inflight_bytes=2 << 20)
STREAMS = 1000
FAULT_EVERY = 50
SIZES = [1, 4095, 64 * 1024, (1 << 20) + 3, 4 << 20]


def lynx_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lynx-"))


def snapshot(pool: ReceivePool) -> dict:
    p = psutil.Process()
    return {"rss_mib": p.memory_info().rss / 2**20, "fds": p.num_fds(),
            "threads": threading.active_count(), "pool_free": pool.free_bytes}


def spawn(rx: Receiver) -> PeerProcess:
    peer = PeerProcess(sender_server, rx.address, CONFIG)
    assert peer.reply(60) == "connected"
    return peer


def test_soak_1000_streams_with_faults(record_property) -> None:
    rng = random.Random(6)
    pool = ReceivePool(64 << 20)
    threads_before = lynx_threads()
    # process-wide state first: UCX's async thread, multiprocessing's resource tracker
    warm = Receiver(ReceivePool(1 << 20), config=CONFIG)
    spawn(warm).close()
    warm.close()
    fds_before = psutil.Process().num_fds()
    rx = Receiver(pool, config=CONFIG)
    peer = spawn(rx)
    outcomes = {"completed": 0, "failed": 0, "cancelled": 0, "rejected": 0}
    faults = {"kill": 0, "corrupt": 0, "cancel": 0}
    after_50 = None
    try:
        for i in range(1, STREAMS + 1):
            if i == 51:
                after_50 = snapshot(pool)  # after the first 50 streams (and the first fault)
            if i % FAULT_EVERY == 0:
                kind = ("kill", "corrupt", "cancel")[(i // FAULT_EVERY) % 3]
                faults[kind] += 1
                if kind == "kill":
                    peer.call("link_rate", (0.5, 64 * 1024))
                    peer.call("start", [("big", 16 << 20, Lane.RESIDUAL, -1)], b"")
                    stream = rx.next_stream(30)
                    peer.kill()
                    with pytest.raises(LynxError):
                        stream.wait(5)
                    peer.close()
                    peer = spawn(rx)
                    outcomes["failed"] += 1
                elif kind == "corrupt":
                    with RawPeer(rx.address) as raw:
                        raw.handshake()
                        raw.send(FrameType.OPEN, struct.pack("!QIII", 1, 4096, 0xFFFFFFFF, 0))
                        raw.expect(FrameType.REJECT)
                        raw.send_raw(b"JUNK" + bytes(8))
                        assert raw.drain_until_closed() == []
                    outcomes["rejected"] += 1
                else:
                    peer.call("link_rate", (0.5, 64 * 1024))
                    sid = peer.call("start", [("c", 8 << 20, Lane.RESIDUAL, -1)], b"")
                    stream = rx.next_stream(30)
                    assert peer.call("cancel", sid, 10.0)["state"] == "cancelled"
                    with pytest.raises(LynxError):
                        stream.wait(5)
                    assert stream.state is StreamState.CANCELLED
                    peer.call("link_rate", None)
                    outcomes["cancelled"] += 1
                continue
            a, r = rng.choice(SIZES), rng.choice(SIZES)
            specs = [("a", a, Lane.ANCHOR, i), ("r", r, Lane.RESIDUAL, i + 100_000)]
            result = peer.call("send", specs, b"", 30.0)
            assert result["state"] == "completed", result
            stream = rx.next_stream(10)
            stream.wait(10)
            assert np.array_equal(stream.view("a"), pattern(i, a))
            assert np.array_equal(stream.view("r")[:4096], pattern(i + 100_000, r)[:4096])
            stream.release()
            outcomes["completed"] += 1
        assert wait_until(lambda: pool.free_bytes == pool.nbytes, 5), "pool regions leaked"
        assert wait_until(lambda: snapshot(pool)["fds"] <= after_50["fds"], 5)
        end = snapshot(pool)
    finally:
        peer.close()
        rx.close()
    peer = None  # a spawned child's Process object holds a pipe until collected
    gc.collect()
    figures = {"after_50": after_50, "end": end, "outcomes": outcomes, "faults": faults,
               "lynx_threads_after_close": lynx_threads(),
               "fds_before_receiver": fds_before, "fds_after_close": psutil.Process().num_fds(),
               "parked_ucx_workers": adapter.PARKED,
               "fd_kinds": sorted(os.readlink(f"/proc/self/fd/{f}").split(":")[0]
                                  for f in os.listdir("/proc/self/fd")
                                  if os.path.exists(f"/proc/self/fd/{f}"))}
    print("soak figures:", figures)
    record_property("soak", figures)
    assert outcomes["completed"] == STREAMS - STREAMS // FAULT_EVERY
    assert end["rss_mib"] <= 1.10 * after_50["rss_mib"], figures
    assert end["fds"] == after_50["fds"], figures
    assert end["threads"] == after_50["threads"], figures
    assert end["pool_free"] == pool.nbytes, figures
    assert lynx_threads() == threads_before, figures
    assert figures["fds_after_close"] == fds_before, figures
