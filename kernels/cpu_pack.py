"""Numba CPU kernels for bit packing: the fast twins of ``lynx_decode.codec._pack``
(same format, bit for bit; the format is defined there).

Each kernel takes uint64 *word* views of whole 64-value blocks (8 words of byte
values <-> ``w`` words of packed fields) and works a block at a time with
shift-and-mask operations that never cross a byte lane, ``prange`` over blocks,
no temporaries, and streaming stores for outputs. The packing width is a
compile-time constant of each kernel (one small kernel per width, sharing an
inlined body), so every shift and mask folds to an immediate.

Importing this module imports numba; nothing is compiled until a kernel is first
called, and ``cache=True`` keeps the machine code on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, prange

from lynx_kernels._nt import store_fence, stream_store

__all__ = ["split_kernel", "merge_kernel", "unpack_kernel", "pack_kernel", "cut_plane", "WIDTHS", "SPLIT_WIDTHS"]

#: Plane widths with a pack/unpack kernel.
WIDTHS = (1, 2, 3, 4, 5, 6)
#: Anchor widths with a split/merge kernel (two-plane splits).
SPLIT_WIDTHS = (2, 3, 4, 5, 6)
_REP = 0x0101010101010101
_CHUNK = 2048  # blocks per parallel work item (128 KiB of codes); each item ends with a fence


@njit(inline="always", cache=True)
def _pack_word(x, base, shift, mask, w, m):  # pragma: no cover - compiled
    # word m of the packed block of the w-bit lane values ((x[base+i] >> shift) & mask)
    rep = np.uint64(_REP)
    acc = np.uint64(0)
    for i in range(8):
        s = i * w - 8 * m
        if -w < s < 8:
            v = (x[base + i] >> np.uint64(shift)) & mask
            if s >= 0:
                acc |= (v << np.uint64(s)) & (np.uint64((0xFF << s) & 0xFF) * rep)
            else:
                acc |= (v >> np.uint64(-s)) & (np.uint64((1 << (w + s)) - 1) * rep)
    return acc


@njit(inline="always", cache=True)
def _unpack_word(p, base, w, i):  # pragma: no cover - compiled
    # word i (8 lane values) of the packed block p[base : base + w]
    rep = np.uint64(_REP)
    acc = np.uint64(0)
    for m in range(w):
        s = i * w - 8 * m
        if -w < s < 8:
            if s >= 0:
                acc |= (p[base + m] >> np.uint64(s)) & (np.uint64((1 << min(w, 8 - s)) - 1) * rep)
            else:
                acc |= (p[base + m] << np.uint64(-s)) & (np.uint64(((1 << (w + s)) - 1) << -s) * rep)
    return acc


@njit(inline="always", cache=True)
def _split(codes, anchor, residual, wa, wr):  # pragma: no cover - compiled
    rep = np.uint64(_REP)
    amask = np.uint64((1 << wa) - 1) * rep
    rmask = np.uint64((1 << wr) - 1) * rep
    nblk = codes.size // 8
    for chunk in prange((nblk + _CHUNK - 1) // _CHUNK):
        for blk in range(chunk * _CHUNK, min(nblk, (chunk + 1) * _CHUNK)):
            for m in range(wa):
                stream_store(anchor, blk * wa + m, _pack_word(codes, blk * 8, wr, amask, wa, m))
            for m in range(wr):
                stream_store(residual, blk * wr + m, _pack_word(codes, blk * 8, 0, rmask, wr, m))
        store_fence()


@njit(inline="always", cache=True)
def _merge(anchor, residual, codes, wa, wr):  # pragma: no cover - compiled
    nblk = codes.size // 8
    for chunk in prange((nblk + _CHUNK - 1) // _CHUNK):
        for blk in range(chunk * _CHUNK, min(nblk, (chunk + 1) * _CHUNK)):
            for i in range(8):
                high = _unpack_word(anchor, blk * wa, wa, i) << np.uint64(wr)
                stream_store(codes, blk * 8 + i, high | _unpack_word(residual, blk * wr, wr, i))
        store_fence()


@njit(inline="always", cache=True)
def _unpack(packed, values, w):  # pragma: no cover - compiled
    nblk = values.size // 8
    for chunk in prange((nblk + _CHUNK - 1) // _CHUNK):
        for blk in range(chunk * _CHUNK, min(nblk, (chunk + 1) * _CHUNK)):
            for i in range(8):
                stream_store(values, blk * 8 + i, _unpack_word(packed, blk * w, w, i))
        store_fence()


@njit(inline="always", cache=True)
def _pack(values, packed, w):  # pragma: no cover - compiled
    mask = np.uint64((1 << w) - 1) * np.uint64(_REP)
    nblk = values.size // 8
    for chunk in prange((nblk + _CHUNK - 1) // _CHUNK):
        for blk in range(chunk * _CHUNK, min(nblk, (chunk + 1) * _CHUNK)):
            for m in range(w):
                stream_store(packed, blk * w + m, _pack_word(values, blk * 8, 0, mask, w, m))
        store_fence()


# One kernel per width (constants fold); codes/values are uint64[8*nblk], packed uint64[w*nblk].
@njit(parallel=True, cache=True)
def _split2(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 2, 6)


@njit(parallel=True, cache=True)
def _split3(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 3, 5)


@njit(parallel=True, cache=True)
def _split4(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 4, 4)


@njit(parallel=True, cache=True)
def _split5(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 5, 3)


@njit(parallel=True, cache=True)
def _split6(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 6, 2)


@njit(parallel=True, cache=True)
def _merge2(a, r, c):  # pragma: no cover - compiled
    _merge(a, r, c, 2, 6)


@njit(parallel=True, cache=True)
def _merge3(a, r, c):  # pragma: no cover - compiled
    _merge(a, r, c, 3, 5)


@njit(parallel=True, cache=True)
def _merge4(a, r, c):  # pragma: no cover - compiled
    _merge(a, r, c, 4, 4)


@njit(parallel=True, cache=True)
def _merge5(a, r, c):  # pragma: no cover - compiled
    _merge(a, r, c, 5, 3)


@njit(parallel=True, cache=True)
def _merge6(a, r, c):  # pragma: no cover - compiled
    _merge(a, r, c, 6, 2)


@njit(parallel=True, cache=True)
def _unpack2(p, v):  # pragma: no cover - compiled
    _unpack(p, v, 2)


@njit(parallel=True, cache=True)
def _unpack3(p, v):  # pragma: no cover - compiled
    _unpack(p, v, 3)


@njit(parallel=True, cache=True)
def _unpack4(p, v):  # pragma: no cover - compiled
    _unpack(p, v, 4)


@njit(parallel=True, cache=True)
def _unpack5(p, v):  # pragma: no cover - compiled
    _unpack(p, v, 5)


@njit(parallel=True, cache=True)
def _unpack6(p, v):  # pragma: no cover - compiled
    _unpack(p, v, 6)


@njit(parallel=True, cache=True)
def _unpack1(p, v):  # pragma: no cover - compiled
    _unpack(p, v, 1)


@njit(parallel=True, cache=True)
def _pack1(v, p):  # pragma: no cover - compiled
    _pack(v, p, 1)


@njit(parallel=True, cache=True)
def _pack2(v, p):  # pragma: no cover - compiled
    _pack(v, p, 2)


@njit(parallel=True, cache=True)
def _pack3(v, p):  # pragma: no cover - compiled
    _pack(v, p, 3)


@njit(parallel=True, cache=True)
def _pack4(v, p):  # pragma: no cover - compiled
    _pack(v, p, 4)


@njit(parallel=True, cache=True)
def _pack5(v, p):  # pragma: no cover - compiled
    _pack(v, p, 5)


@njit(parallel=True, cache=True)
def _pack6(v, p):  # pragma: no cover - compiled
    _pack(v, p, 6)


@njit(cache=True, nogil=True)
def cut_plane(codes, packed, shift, w):  # pragma: no cover - compiled
    """``cut_plane(codes, packed, shift, w)``: the ``w``-bit slice at ``shift`` of 8-bit codes
    (uint64 words of whole blocks) -> its packed words. Serial and ``nogil`` on the calling thread
    (no parallel launch, no lock): the prefill node cuts LYNX planes from held INT8 codes on its
    send path, beside a decode node that may hold both cores, where a parallel launch waits for
    every one of its threads to be scheduled."""
    mask = np.uint64((1 << w) - 1) * np.uint64(_REP)
    for blk in range(codes.size // 8):
        for m in range(w):
            packed[blk * w + m] = _pack_word(codes, blk * 8, shift, mask, w, m)


# The same splits serial and nogil, on the calling thread (see cut_plane for why).
@njit(cache=True, nogil=True)
def _split2s(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 2, 6)


@njit(cache=True, nogil=True)
def _split3s(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 3, 5)


@njit(cache=True, nogil=True)
def _split4s(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 4, 4)


@njit(cache=True, nogil=True)
def _split5s(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 5, 3)


@njit(cache=True, nogil=True)
def _split6s(c, a, r):  # pragma: no cover - compiled
    _split(c, a, r, 6, 2)


_SPLIT_SERIAL = {2: _split2s, 3: _split3s, 4: _split4s, 5: _split5s, 6: _split6s}
_SPLIT = {2: _split2, 3: _split3, 4: _split4, 5: _split5, 6: _split6}
_MERGE = {2: _merge2, 3: _merge3, 4: _merge4, 5: _merge5, 6: _merge6}
_UNPACK = {1: _unpack1, 2: _unpack2, 3: _unpack3, 4: _unpack4, 5: _unpack5, 6: _unpack6}
_PACK = {1: _pack1, 2: _pack2, 3: _pack3, 4: _pack4, 5: _pack5, 6: _pack6}


def split_kernel(bits: int, *, serial: bool = False) -> Callable[[Any, Any, Any], None]:
    """``k(codes, anchor, residual)``: 8-bit codes -> anchor (``bits``) and residual (``8 - bits``) words
    (``serial``: on the calling thread, ``nogil``, no lock needed)."""
    return (_SPLIT_SERIAL if serial else _SPLIT)[bits]


def merge_kernel(bits: int) -> Callable[[Any, Any, Any], None]:
    """``k(anchor, residual, codes)``: inverse of :func:`split_kernel`."""
    return _MERGE[bits]


def unpack_kernel(width: int) -> Callable[[Any, Any], None]:
    """``k(packed, values)``: ``width``-bit fields -> one value per byte."""
    return _UNPACK[width]


def pack_kernel(width: int) -> Callable[[Any, Any], None]:
    """``k(values, packed)``: one value per byte -> ``width``-bit fields."""
    return _PACK[width]
