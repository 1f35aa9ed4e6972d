"""The Numba backend: CPU kernels in ``lynx_kernels.cpu_*``, compiled on first use and
cached on disk.

``NumbaOps`` overrides :meth:`~lynx_decode.codec.backends.base.Ops.encode` and
``decode`` for two-plane splits and the baselines with fused single-pass kernels
(``lynx_kernels.cpu_codec``) that run on the calling thread: one ``parallel=True``
launch per stage would cost a thread-pool barrier each time, plus NumPy
temporaries in between (expensive on a loaded host; docs/design.md, "Measured
facts").
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from lynx_decode.codec import quant
from lynx_decode.codec.backends.base import Ops, levels_of
from lynx_decode.codec.config import CodecConfig, Scheme, Split
from lynx_decode.codec.layout import LayerLayout
from lynx_decode.errors import CodecError
from lynx_transport.errors import BackendError

__all__ = ["NumbaOps", "head_strided"]

_NO_BYTES = np.zeros(0, np.uint8)


def head_strided(out: Any) -> tuple[Any, int]:
    """A flat 1-D view of ``out [H,T,D]`` (each head's ``[T,D]`` block C-contiguous,
    heads any whole number of elements apart) and the head stride in elements:
    element ``(h, t, d)`` is ``flat[h * stride + t * D + d]``."""
    heads, tokens, dim = out.shape
    item = out.itemsize
    stride = out.strides[0] // item if heads > 1 else tokens * dim
    span = (heads - 1) * stride + tokens * dim
    return np.lib.stride_tricks.as_strided(out, shape=(span,), strides=(item,)), stride


def _words(a: Any) -> Any:
    return a.view(np.uint64)


_NUMBA_LOCK = threading.Lock()


def _locked(fn: Any) -> Any:
    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        # Numba's parallel kernels already use every core, and its fallback threading
        # layer (workqueue) aborts on concurrent launches: run one kernel at a time.
        with _NUMBA_LOCK:
            return fn(*args)

    return run


class NumbaOps(Ops):
    """Numba CPU kernels, cached on disk. :meth:`encode`/:meth:`decode` (the codec's
    path) are fused serial ``nogil`` kernels, safe to run from several threads at
    once; the per-stage ``parallel=True`` kernels (bulk packing, :func:`int8_codes`)
    are serialised by a lock."""

    name = "numba"

    def __init__(self) -> None:
        try:
            from lynx_kernels import cpu_codec, cpu_pack, cpu_quant  # noqa: PLC0415 - numba is imported on first use
        except ImportError as exc:
            raise BackendError(f"the numba backend is unavailable: {exc} (pip install numba)") from exc
        self._codec = cpu_codec
        self._pack = cpu_pack
        self._quant = cpu_quant

    def minmax(self, x: Any, group: int, kind: str, what: str) -> tuple[Any, Any]:
        heads, tokens, dim = x.shape
        shape = (heads, -(-tokens // group), dim) if kind == "k" else (heads, tokens, -(-dim // group))
        lo = np.empty(shape, np.float32)
        hi = np.empty(shape, np.float32)
        bad = np.zeros(shape[0] * shape[1], np.bool_)
        with _NUMBA_LOCK:
            (self._quant.minmax_k if kind == "k" else self._quant.minmax_v)(x, group, lo, hi, bad)
        if bad.any():
            raise CodecError(
                f"{what} contains non-finite values (NaN or inf) in {int(bad.sum())} quantization group(s)"
            )
        return lo, hi

    @_locked
    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        (self._quant.quantize_k if kind == "k" else self._quant.quantize_v)(x, inv, zero, group, levels, out)

    def end_codes(self, values: Any, shift: int, group: int, kind: str) -> tuple[Any, Any]:
        heads, tokens, dim = values.shape
        shape = (heads, -(-tokens // group), dim) if kind == "k" else (heads, tokens, -(-dim // group))
        lo = np.empty(shape, np.float32)
        hi = np.empty(shape, np.float32)
        # a serial nogil pass (no thread-pool barrier): no launch lock needed
        (self._quant.end_codes_k if kind == "k" else self._quant.end_codes_v)(values, shift, group, lo, hi)
        return lo, hi

    @_locked
    def dequant(
        self, values: Any, shift: int, offset: float, ends: tuple[Any, Any] | None, scale: Any, zero: Any,
        group: int, kind: str, out: Any,
    ) -> None:
        q = self._quant
        mult, off = np.float32(1 << shift), np.float32(offset)
        top, lo, hi = (np.int32(-1), scale, scale) if ends is None else (np.int32(255 >> shift), *ends)
        (q.dequant_k if kind == "k" else q.dequant_v)(values, mult, off, top, lo, hi, scale, zero, group, out)

    def to_bf16(self, x: Any, out: Any) -> None:
        self._codec.to_bf16(x.reshape(-1).view(np.uint32), out.reshape(-1))

    def from_bf16(self, bits: Any, out: Any) -> None:
        flat, head_stride = head_strided(out)
        self._codec.from_bf16(bits.reshape(-1), out.shape[1], out.shape[2], flat.view(np.uint32), head_stride)

    def encode(self, x: Any, kind: str, config: CodecConfig, scale: Any, zero: Any, outs: Sequence[Any]) -> None:
        # one fused pass on the calling thread (lynx_kernels.cpu_codec): no launch lock needed
        if len(outs) > 2:  # three or more planes: the composed per-stage kernels
            super().encode(x, kind, config, scale, zero, outs)
            return
        data, residual = outs[0], (outs[1] if len(outs) > 1 else None)
        c = self._codec
        _heads, tokens, dim = x.shape
        mode = {Scheme.INT8: c.ENC_INT8, Scheme.INT4: c.ENC_INT4}.get(config.scheme, c.ENC_LYNX)
        if mode == c.ENC_LYNX and residual is None:
            mode = c.ENC_ANCHOR
        elif mode == c.ENC_LYNX and data is None:
            mode, data = c.ENC_RESIDUAL, _NO_BYTES
        fn, group = (c.encode_k, config.k_group) if kind == "k" else (c.encode_v, config.v_group)
        res = _NO_BYTES if residual is None else residual
        levels = levels_of(config.scheme)
        rounded = levels == 255 and config.split is Split.ROUNDED
        bad_x, bad_p = fn(
            x.reshape(-1), tokens, dim, group, levels, rounded, config.bits, mode,
            scale.reshape(-1).view(np.uint16), zero.reshape(-1).view(np.uint16), data.reshape(-1), res,
        )  # fmt: skip
        what = kind.upper()
        if bad_x:
            raise CodecError(f"{what} contains non-finite values (NaN or inf) in {bad_x} quantization group(s)")
        if bad_p:
            raise CodecError(
                f"{what} contains non-finite values or values outside the fp16 range (|x| > 65504) "
                f"in {bad_p} quantization group(s)"
            )

    def decode(self, layout: LayerLayout, kind: str, planes: Sequence[Any], scale: Any, zero: Any, out: Any) -> None:
        if layout.num_planes > 2:  # three or more planes: the composed per-stage kernels
            super().decode(layout, kind, planes, scale, zero, out)
            return
        c = self._codec
        data, residual = planes[0], (planes[1] if len(planes) > 1 else None)
        if layout.scheme is Scheme.INT8:
            mode, shift, offset = c.DEC_INT8, 0, 0.0
        elif layout.scheme is Scheme.INT4:
            mode, shift, offset = c.DEC_INT4, 0, 0.0
        elif residual is None:
            offset = quant.prefix_offset(layout.split, layout.bits, layout.bits)
            mode = c.DEC_ANCHOR_OCC if quant.occ_mean(layout.split, layout.bits) else c.DEC_ANCHOR
            shift = 8 - layout.bits
        else:
            mode, shift, offset = c.DEC_FULL, 0, 0.0
        fn, group = (c.decode_k, layout.k_group) if kind == "k" else (c.decode_v, layout.v_group)
        flat, head_stride = head_strided(out)
        fn(
            data.reshape(-1), _NO_BYTES if residual is None else residual, layout.tokens, layout.head_dim, group, mode,
            layout.bits, np.float32(1 << shift), np.float32(offset), scale.reshape(-1).view(np.uint16),
            zero.reshape(-1).view(np.uint16), flat, head_stride,
        )  # fmt: skip

    def cut_planes(self, codes: Any, config: CodecConfig, outs: Sequence[Any]) -> None:
        # serial, on the calling thread (a prefill node's send path, beside a busy decode node):
        # both planes of a two-plane split in one pass, else one pass a plane (cpu_pack.cut_plane)
        words = _words(codes)
        if len(outs) == 2 and all(out is not None for out in outs):
            self._pack.split_kernel(config.bits, serial=True)(words, _words(outs[0]), _words(outs[1]))
            return
        for plane, out in zip(config.plane_table, outs):
            if out is not None:
                self._pack.cut_plane(words, _words(out), plane.shift, plane.bits)

    @_locked
    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        self._pack.split_kernel(bits)(_words(codes), _words(anchor), _words(residual))

    @_locked
    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        self._pack.merge_kernel(bits)(_words(anchor), _words(residual), _words(codes))

    @_locked
    def pack(self, values: Any, width: int, packed: Any) -> None:
        self._pack.pack_kernel(width)(_words(values), _words(packed))

    @_locked
    def unpack(self, packed: Any, width: int, values: Any) -> None:
        self._pack.unpack_kernel(width)(_words(packed), _words(values))
