"""Reference bit packing (defines the wire format; works on NumPy and CuPy arrays).

Values are packed in blocks of 64 (the last block is padded with zeros). Inside
block ``B``, value ``j = 64*B + 8*i + k`` sits in *word* ``i`` (0..7), *lane*
``k`` (0..7) -- i.e. the values viewed as little-endian uint64 words of 8 bytes.
For ``w``-bit values, lane ``k`` of the block forms the ``8w``-bit integer
``S_k = sum_i v[i, k] << (i*w)``, and the packed block is ``w`` little-endian
uint64 words whose byte ``k`` of word ``m`` is byte ``m`` of ``S_k``.

So every ``w`` packed bytes hold 8 values (two 4-bit values per byte, eight
3-bit values per 3 bytes), a block is exactly ``8w`` bytes, a stream of ``n``
values is ``ceil(n/64) * 8w`` bytes, and packing works on whole words with
shift-and-mask operations that never cross a byte lane (fast in SIMD and CUDA).
For b = 4 the anchor word ``m`` is simply
``((x[2m] >> 4) & 0x0F..0F) | (x[2m+1] & 0xF0..F0)``.
"""

from __future__ import annotations

import sys
from typing import Any

from lynx_decode.errors import CodecError

__all__ = ["BLOCK", "packed_size", "pack", "unpack", "split", "merge"]

BLOCK = 64
_CHUNK = 1 << 16  # blocks per step of the reference (bounds its temporaries)


def packed_size(n: int, width: int) -> int:
    """Bytes of a packed stream of ``n`` values of ``width`` bits."""
    return -(-n // BLOCK) * 8 * width


def _check_host_order() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise CodecError("the codec format assumes a little-endian host")


def pack(values: Any, width: int, xp: Any) -> Any:
    """Pack uint8 values ``< 2**width`` (any shape, C order) into ``packed_size`` bytes."""
    _check_host_order()
    n = int(values.size)
    flat = values.reshape(-1)
    out = xp.empty(packed_size(n, width), dtype=xp.uint8)
    shifts = (xp.arange(8, dtype=xp.uint64) * xp.uint64(width))[None, :, None]
    for first in range(0, max(n, 1), _CHUNK * BLOCK):  # blocks are independent: bound the temporaries
        chunk = flat[first : first + _CHUNK * BLOCK]
        blocks = -(-int(chunk.size) // BLOCK)
        v = xp.zeros(blocks * BLOCK, dtype=xp.uint64)
        v[: chunk.size] = chunk
        lanes = (v.reshape(blocks, 8, 8) << shifts).sum(axis=1, dtype=xp.uint64)  # [B, k] = S_k
        packed = lanes.view(xp.uint8).reshape(blocks, 8, 8)[:, :, :width].transpose(0, 2, 1)  # [B, m, k]
        start = first // BLOCK * 8 * width
        out[start : start + blocks * 8 * width] = packed.reshape(-1)
    return out


def unpack(packed: Any, n: int, width: int, xp: Any) -> Any:
    """Inverse of :func:`pack`: ``n`` uint8 values of ``width`` bits."""
    _check_host_order()
    if int(packed.size) != packed_size(n, width):
        raise CodecError(
            f"packed stream has {packed.size} bytes, expected {packed_size(n, width)} for {n} values of {width} bits"
        )
    out = xp.empty(n, dtype=xp.uint8)
    shifts = (xp.arange(8, dtype=xp.uint64) * xp.uint64(width))[None, :, None]
    mask = xp.uint64((1 << width) - 1)
    flat = packed.reshape(-1)
    for first in range(0, n, _CHUNK * BLOCK):
        count = min(n - first, _CHUNK * BLOCK)
        blocks = -(-count // BLOCK)
        start = first // BLOCK * 8 * width
        buf = xp.zeros((blocks, 8, 8), dtype=xp.uint8)  # [B, k, m]
        buf[:, :, :width] = flat[start : start + blocks * 8 * width].reshape(blocks, width, 8).transpose(0, 2, 1)
        lanes = buf.reshape(-1).view(xp.uint64).reshape(blocks, 1, 8)
        values = (lanes >> shifts) & mask  # [B, i, k]
        out[first : first + count] = values.reshape(-1)[:count]
    return out


def split(codes: Any, bits: int, xp: Any) -> tuple[Any, Any]:
    """8-bit codes -> (anchor: packed top ``bits`` bits, residual: packed low ``8 - bits``)."""
    rbits = 8 - bits
    flat = codes.reshape(-1)
    anchor = pack(flat >> xp.uint8(rbits), bits, xp)
    residual = pack(flat & xp.uint8((1 << rbits) - 1), rbits, xp)
    return anchor, residual


def merge(anchor: Any, residual: Any, n: int, bits: int, xp: Any) -> Any:
    """Inverse of :func:`split`: exactly the ``n`` 8-bit codes."""
    rbits = 8 - bits
    high = unpack(anchor, n, bits, xp)
    low = unpack(residual, n, rbits, xp)
    return (high << xp.uint8(rbits)) | low
