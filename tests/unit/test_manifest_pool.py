"""Carving manifests' regions out of the receive pool: all-or-nothing, no overlap, coalescing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_transport.errors import PoolExhaustedError
from lynx_transport.protocol.pool import ALIGNMENT, ReceivePool


def test_views_are_inside_the_pool_and_not_copies() -> None:
    pool = ReceivePool(1 << 20)
    (off,) = pool.allocate([1000])
    view = pool.view(off, 1000)
    assert pool.base_address <= view.ctypes.data < pool.base_address + pool.nbytes
    view[:] = 7
    assert np.all(pool.buffer[off:off + 1000] == 7)
    assert pool.base_address % 4096 == 0


def test_exhaustion_is_all_or_nothing() -> None:
    pool = ReceivePool(10 * ALIGNMENT)
    pool.allocate([4 * ALIGNMENT])
    with pytest.raises(PoolExhaustedError, match="cannot hold"):
        pool.allocate([3 * ALIGNMENT, 4 * ALIGNMENT])
    assert pool.free_bytes == 6 * ALIGNMENT


def test_double_release_is_refused() -> None:
    pool = ReceivePool(4 * ALIGNMENT)
    (off,) = pool.allocate([ALIGNMENT])
    pool.release(off, ALIGNMENT)
    with pytest.raises(ValueError, match="already free"):
        pool.release(off, ALIGNMENT)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 5000), min_size=1, max_size=4)),
                    max_size=40))
def test_random_alloc_free_never_overlaps_and_coalesces(ops: list) -> None:
    pool = ReceivePool(64 * 1024)
    live: list[tuple[int, int]] = []
    for do_free, sizes in ops:
        if do_free and live:
            off, size = live.pop(0)
            pool.release(off, size)
            continue
        try:
            offs = pool.allocate(sizes)
        except PoolExhaustedError:
            continue
        live.extend(zip(offs, sizes))
        spans = sorted((o, o + max(s, 1)) for o, s in live)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(o >= 0 and e <= pool.nbytes for o, e in spans)
    for off, size in live:
        pool.release(off, size)
    assert pool.free_bytes == pool.nbytes
    assert pool._free == [(0, pool.nbytes)]
