"""The CuPy backend: CUDA kernels from ``lynx_kernels/codec.cu`` (compiled lazily,
cached per device by :mod:`lynx_kernels.cuda`); group extremes and fp16 parameter
rounding run as CuPy array operations through the same reference code as NumPy.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from lynx_decode.codec_backends import ReferenceOps
from lynx_transport.errors import BackendError

__all__ = ["CupyOps", "cupy_ops"]

_THREADS = 256


class CupyOps(ReferenceOps):
    """CUDA kernels for quantize/dequantize/split/merge/pack/unpack."""

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

    def dequant(
        self, values: Any, shift: int, offset: float, scale: Any, zero: Any, group: int, kind: str, out: Any
    ) -> None:
        n = values.size
        self._launch(
            "lynx_dequant", n, values, np.float32(1 << shift), np.float32(offset), scale, zero, out,
            *self._dims(values.shape, group, kind), np.int64(n),
        )  # fmt: skip

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
