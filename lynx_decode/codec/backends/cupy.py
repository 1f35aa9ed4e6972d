"""The CuPy backend: CUDA kernels from ``lynx_kernels/codec.cu`` (compiled lazily,
cached per device by :mod:`lynx_kernels.cuda`); group extremes and fp16 parameter
rounding run as CuPy array operations through the same reference code as NumPy.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from lynx_decode.codec.backends.base import ReferenceOps
from lynx_transport.errors import BackendError

__all__ = ["CupyOps", "cupy_ops"]

_THREADS = 256


class CupyOps(ReferenceOps):
    """CUDA kernels for quantize/dequantize/split/merge/pack/unpack and the occ-mean
    end codes of a prefix (one thread per quantization group)."""

    name = "cupy"

    def __init__(self) -> None:
        try:
            import cupy  # noqa: PLC0415 - optional dependency

            from lynx_kernels import cuda  # noqa: PLC0415
        except ImportError as exc:
            raise BackendError(f"the cupy backend is unavailable: {exc} (pip install 'lynx-kv[gpu]')") from exc
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise BackendError(f"the cupy backend has no usable CUDA device: {exc}") from exc
        if count < 1:
            raise BackendError("the cupy backend has no CUDA device")
        super().__init__(cupy)
        self._cuda = cuda

    def _launch(self, name: str, items: int, *args: Any) -> None:
        blocks = max(1, -(-items // _THREADS))
        self._cuda.function(name)((blocks,), (_THREADS,), args)

    def _dims(self, shape: tuple[int, ...], group: int, kind: str) -> tuple[Any, ...]:
        heads, tokens, dim = shape
        return (np.int32(heads), np.int32(tokens), np.int32(dim), np.int32(group), np.int32(0 if kind == "k" else 1))

    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        n = x.size
        self._launch(
            "lynx_quantize", n, x, inv, zero, out, *self._dims(x.shape, group, kind), np.float32(levels), np.int64(n)
        )

    def end_codes(self, values: Any, shift: int, group: int, kind: str) -> tuple[Any, Any]:
        heads, tokens, dim = values.shape
        shape = (heads, -(-tokens // group), dim) if kind == "k" else (heads, tokens, -(-dim // group))
        lo = self.xp.empty(shape, self.xp.float32)
        hi = self.xp.empty(shape, self.xp.float32)
        self._launch("lynx_end_codes", lo.size, values, lo, hi, *self._dims(values.shape, group, kind),
                     np.int32(shift), np.int64(lo.size))
        return lo, hi

    def dequant(
        self, values: Any, shift: int, offset: float, ends: tuple[Any, Any] | None, scale: Any, zero: Any,
        group: int, kind: str, out: Any,
    ) -> None:
        n = values.size
        mult, off, dims = np.float32(1 << shift), np.float32(offset), self._dims(values.shape, group, kind)
        if ends is None:
            self._launch("lynx_dequant", n, values, mult, off, scale, zero, out, *dims, np.int64(n))
        else:
            self._launch("lynx_dequant_ends", n, values, mult, off, np.int32(255 >> shift), ends[0], ends[1],
                         scale, zero, out, *dims, np.int64(n))

    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        nblk = codes.size // 64
        self._launch("lynx_split", nblk, codes, anchor, residual, np.int64(nblk), np.int32(bits))

    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        nblk = codes.size // 64
        self._launch("lynx_merge", nblk, anchor, residual, codes, np.int64(nblk), np.int32(bits))

    def pack(self, values: Any, width: int, packed: Any) -> None:
        nblk = values.size // 64
        self._launch("lynx_pack", nblk, values, packed, np.int64(nblk), np.int32(width))

    def unpack(self, packed: Any, width: int, values: Any) -> None:
        nblk = values.size // 64
        self._launch("lynx_unpack", nblk, packed, values, np.int64(nblk), np.int32(width))


@functools.cache
def cupy_ops() -> CupyOps:
    return CupyOps()
