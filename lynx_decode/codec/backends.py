"""Codec backends: one small class per implementation of the same format.

``ReferenceOps`` (NumPy; defines the format), ``NumbaOps`` (CPU kernels in
``lynx_kernels.cpu_*``) and ``CupyOps`` (CUDA kernels in ``lynx_kernels/codec.cu``,
see :mod:`lynx_decode.codec.gpu`) implement the same :class:`Ops` methods on
arrays of their kind. :func:`select` picks one by the arrays' module or by an
explicit :class:`Backend`; asking for an unavailable backend raises
:class:`BackendError`, and only ``Backend.AUTO`` falls back (Numba -> NumPy).

Code buffers handed between ops are flat uint8 arrays padded with zeros to whole
64-value blocks (``padded(n)`` bytes), so packing kernels never see a tail.

The codec calls two whole-tensor methods, :meth:`Ops.encode` and
:meth:`Ops.decode`, each with one region per plane of the layer's plane table.
Their default composes the per-stage kernels (what the reference and CuPy run,
and every backend for splits of three or more planes); ``NumbaOps`` overrides
them for two-plane splits and the baselines with fused single-pass kernels
(``lynx_kernels.cpu_codec``) that run on the calling thread: a layer is
a few MB, and a ``parallel=True`` launch per stage cost a thread-pool barrier
(~8 ms on a loaded 2-core box) each time, plus NumPy temporaries in between.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from lynx_decode.codec import pack as pk
from lynx_decode.codec import quant as qt
from lynx_decode.codec.config import Backend, CodecConfig, Scheme, Split
from lynx_decode.codec.layout import LayerLayout
from lynx_decode.errors import CodecError
from lynx_transport.errors import BackendError

__all__ = ["Ops", "ReferenceOps", "NumbaOps", "select", "padded", "levels_of", "codes_of"]


def padded(n: int) -> int:
    """Bytes of a code buffer of ``n`` values padded to whole blocks."""
    return -(-n // pk.BLOCK) * pk.BLOCK


class Ops:
    """The kernels one backend provides (all arrays of ``self.xp``)."""

    name = "abstract"
    xp: Any = np

    def minmax(self, x: Any, group: int, kind: str, what: str) -> tuple[Any, Any]:
        """fp32 group extremes of fp32 ``x [H,T,D]`` (``kind`` 'k' or 'v')."""
        raise NotImplementedError

    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        """Write uint8 codes of ``x`` into ``out [H,T,D]`` (params fp32, group-shaped)."""
        raise NotImplementedError

    def end_codes(self, values: Any, shift: int, group: int, kind: str) -> tuple[Any, Any]:
        """occ-mean codes of the bottom and top bins of prefix values
        ``values = q >> shift [H,T,D]``: fp32 ``(lo, hi)``, group-shaped like the
        scales (:func:`lynx_decode.codec.quant.end_codes`)."""
        raise NotImplementedError

    def dequant(
        self, values: Any, shift: int, offset: float, ends: tuple[Any, Any] | None, scale: Any, zero: Any,
        group: int, kind: str, out: Any,
    ) -> None:
        """Write fp32 ``code * scale + zero`` into ``out [H,T,D]``, ``code =
        values*2**shift + offset``; with ``ends`` (from :meth:`end_codes`) the bottom
        bin (``values == 0``) takes ``ends[0]`` and the top (``255 >> shift``) ``ends[1]``."""
        raise NotImplementedError

    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        """Padded codes -> packed anchor/residual regions (``packed_size`` bytes each)."""
        raise NotImplementedError

    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        """Packed anchor + residual -> padded 8-bit codes."""
        raise NotImplementedError

    def pack(self, values: Any, width: int, packed: Any) -> None:
        """Padded values -> packed region."""
        raise NotImplementedError

    def unpack(self, packed: Any, width: int, values: Any) -> None:
        """Packed region -> padded values."""
        raise NotImplementedError

    def to_bf16(self, x: Any, out: Any) -> None:
        """bfloat16 bit patterns (round to nearest even) of fp32 ``x`` into uint16 ``out``."""
        out[...] = qt.f32_to_bf16_bits(x, self.xp).reshape(out.shape)

    def from_bf16(self, bits: Any, out: Any) -> None:
        """fp32 ``out [H,T,D]`` (heads may be strided) from bfloat16 bit patterns."""
        out[...] = qt.bf16_bits_to_f32(bits, self.xp).reshape(out.shape)

    def encode(self, x: Any, kind: str, config: CodecConfig, scale: Any, zero: Any, outs: Sequence[Any]) -> None:
        """Quantize fp32 ``x [H,T,D]`` into its wire regions: fp16 ``scale``/``zero``
        (group-shaped) and ``outs``, one region per plane of ``config.plane_table``
        (plane 0: INT8 codes, packed INT4 codes, or LYNX's packed top plane); a
        plane that is not wanted is None (then ``scale``/``zero`` may be scratch).
        Raises :class:`CodecError` for non-finite values. This default composes
        the per-stage kernels."""
        xp = self.xp
        group = config.k_group if kind == "k" else config.v_group
        levels = levels_of(config.scheme)
        lo, hi = self.minmax(x, group, kind, kind.upper())
        s, z = qt.group_params(lo, hi, levels, config.split, config.bits, xp, kind.upper())
        scale[...] = s
        zero[...] = z
        inv, z32 = qt.inverse(s, xp), z.astype(xp.float32)
        if config.scheme is Scheme.INT8:
            self.quantize(x, inv, z32, group, kind, levels, outs[0].reshape(x.shape))
            return
        n = x.size
        codes = xp.zeros(padded(n), dtype=xp.uint8)
        self.quantize(x, inv, z32, group, kind, levels, codes[:n].reshape(x.shape))
        table = config.plane_table
        if len(table) == 2 and all(out is not None for out in outs):
            self.split(codes, config.bits, outs[0], outs[1])
            return
        for plane, out in zip(table, outs):
            if out is not None:
                self.pack((codes >> xp.uint8(plane.shift)) & xp.uint8(plane.mask), plane.bits, out)

    def decode(self, layout: LayerLayout, kind: str, planes: Sequence[Any], scale: Any, zero: Any, out: Any) -> None:
        """Dequantize one tensor from the regions of its first ``len(planes)`` planes
        (all of them: exact; fewer: a LYNX layer from its top bits, the end bins of
        an MSB grid by occupancy, :meth:`end_codes`) into fp32 ``out [H,T,D]``,
        which may be strided between heads (each head's ``[T,D]`` block
        contiguous). This default composes the per-stage kernels."""
        xp = self.xp
        values, shift = codes_of(self, layout, planes)
        group = layout.k_group if kind == "k" else layout.v_group
        offset = qt.prefix_offset(layout.split, layout.bits, 8 - shift)
        ends = self.end_codes(values, shift, group, kind) if qt.occ_mean(layout.split, 8 - shift) else None
        target = out if out.flags.c_contiguous else xp.empty(layout.shape, dtype=xp.float32)
        self.dequant(values, shift, offset, ends, scale.astype(xp.float32), zero.astype(xp.float32), group, kind,
                     target)
        if target is not out:
            out[...] = target


def levels_of(scheme: Scheme) -> int:
    """Quantization levels of a quantized scheme (15 for INT4, else 255)."""
    return 15 if scheme is Scheme.INT4 else 255


def codes_of(ops: Ops, layout: LayerLayout, planes: Sequence[Any]) -> tuple[Any, int]:
    """(values [H,T,D] uint8, shift): the known top ``8 - shift`` bits of every code,
    ``values = q >> shift``, from the regions of a tensor's first ``len(planes)``
    planes (all of them, or a one-plane scheme: the codes, shift 0)."""
    xp = ops.xp
    n = layout.kv_heads * layout.tokens * layout.head_dim
    if layout.scheme is Scheme.INT8:
        return planes[0].reshape(layout.shape), 0
    values = xp.empty(padded(n), dtype=xp.uint8)
    table = layout.plane_table
    if layout.scheme is Scheme.INT4:
        ops.unpack(planes[0], 4, values)
        return values[:n].reshape(layout.shape), 0
    if len(planes) == 2 == len(table):
        ops.merge(planes[0], planes[1], layout.bits, values)
    else:
        ops.unpack(planes[0], table[0].bits, values)
        if len(planes) > 1:
            low = xp.empty_like(values)
            for plane, data in zip(table[1:], planes[1:]):
                ops.unpack(data, plane.bits, low)
                values <<= xp.uint8(plane.bits)
                values |= low
    return values[:n].reshape(layout.shape), table[len(planes) - 1].shift


class ReferenceOps(Ops):
    """The NumPy reference: the definition of the format."""

    name = "numpy"

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp

    def minmax(self, x: Any, group: int, kind: str, what: str) -> tuple[Any, Any]:
        fn = qt.group_minmax_k if kind == "k" else qt.group_minmax_v
        return fn(x, group, self.xp)

    def _expand(self, p: Any, group: int, kind: str, shape: tuple[int, ...]) -> Any:
        if kind == "k":
            return qt.expand_k(p, group, shape[1], self.xp)
        return qt.expand_v(p, group, shape[2], self.xp)

    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        e = functools.partial(self._expand, group=group, kind=kind, shape=x.shape)
        out[...] = qt.quantize(x, e(inv), e(zero), levels, self.xp)

    def end_codes(self, values: Any, shift: int, group: int, kind: str) -> tuple[Any, Any]:
        return qt.end_codes(values, shift, group, kind, self.xp)

    def dequant(
        self, values: Any, shift: int, offset: float, ends: tuple[Any, Any] | None, scale: Any, zero: Any,
        group: int, kind: str, out: Any,
    ) -> None:
        e = functools.partial(self._expand, group=group, kind=kind, shape=values.shape)
        wide = None if ends is None else (e(ends[0]), e(ends[1]))
        out[...] = qt.dequantize(values, shift, offset, e(scale), e(zero), self.xp, wide)

    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        a, r = pk.split(codes, bits, self.xp)
        anchor[...] = a
        residual[...] = r

    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        codes[...] = pk.merge(anchor, residual, codes.size, bits, self.xp)

    def pack(self, values: Any, width: int, packed: Any) -> None:
        packed[...] = pk.pack(values, width, self.xp)

    def unpack(self, packed: Any, width: int, values: Any) -> None:
        values[...] = pk.unpack(packed, values.size, width, self.xp)


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
            offset = qt.prefix_offset(layout.split, layout.bits, layout.bits)
            mode = c.DEC_ANCHOR_OCC if qt.occ_mean(layout.split, layout.bits) else c.DEC_ANCHOR
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


@functools.cache
def _numba_ops() -> NumbaOps:
    return NumbaOps()


def select(backend: Backend, xp: Any) -> Ops:
    """The ops for ``backend`` on arrays of module ``xp`` (BackendError if unavailable)."""
    if not isinstance(backend, Backend):
        raise CodecError(f"backend must be a Backend, got {backend!r}")
    on_device = xp is not np
    if on_device:
        if backend not in (Backend.AUTO, Backend.CUPY):
            raise BackendError(f"the {backend.value} backend runs on host arrays, but the inputs are CuPy arrays")
        from lynx_decode.codec.gpu import cupy_ops  # noqa: PLC0415 - GPU code only when a GPU array arrives

        return cupy_ops()
    if backend is Backend.CUPY:
        from lynx_decode.codec.gpu import cupy_ops  # noqa: PLC0415

        cupy_ops()  # raises BackendError when CuPy or a device is missing
        raise CodecError("the cupy backend needs CuPy arrays; move the inputs with cupy.asarray first")
    if backend is Backend.NUMPY:
        return ReferenceOps()
    try:
        return _numba_ops()
    except BackendError:
        if backend is Backend.AUTO:
            return ReferenceOps()
        raise
