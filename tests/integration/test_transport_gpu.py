"""A CuPy receive pool: bytes sent from another process land in device memory.

Marked ``gpu``: skipped by the capability probe in tests/conftest.py where
CuPy or a CUDA device is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from lynx_transport import Lane, PoolMemory, ReceivePool, Receiver, StreamState, TransportConfig
from lynx_transport.testing import PeerProcess, pattern, sender_server

pytestmark = [pytest.mark.gpu, pytest.mark.ucx]


def test_cuda_pool_receives_from_another_process_into_device_memory() -> None:
    import cupy

    config = TransportConfig(chunk_bytes=1 << 20, max_inflight_bytes=4 << 20)
    pool = ReceivePool(64 << 20, memory=PoolMemory.CUDA)
    assert pool.device is not None
    with Receiver(pool, config=config) as rx, PeerProcess(sender_server, rx.address, config) as peer:
        assert peer.reply(120) == "connected"
        specs = [("anchor", 3 << 20, Lane.ANCHOR, 11), ("residual", (5 << 20) + 17, Lane.RESIDUAL, 12)]
        result = peer.call("send", specs, b"gpu", 60.0)
        assert result["state"] == "completed", result
        stream = rx.next_stream(30)
        stream.wait(30)
        assert stream.state is StreamState.COMPLETED
        for name, n, _, seed in specs:
            view = stream.view(name)
            assert isinstance(view, cupy.ndarray)  # device memory, no host staging buffer
            ptr = view.data.ptr
            assert pool.base_address <= ptr < pool.base_address + pool.nbytes
            assert np.array_equal(cupy.asnumpy(view), pattern(seed, n))
        stream.release()
        assert pool.free_bytes == pool.nbytes
