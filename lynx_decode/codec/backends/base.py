"""The backend interface (:class:`Ops`) and the NumPy reference that defines the format.

Code buffers handed between ops are flat uint8 arrays padded with zeros to whole
64-value blocks (``padded(n)`` bytes), so packing kernels never see a tail.

The codec calls two whole-tensor methods, :meth:`Ops.encode` and
:meth:`Ops.decode`, each with one region per plane of the layer's plane table.
Their default composes the per-stage kernels (what the reference and CuPy run,
and every backend for splits of three or more planes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from lynx_decode.codec import pack as bitpack
from lynx_decode.codec import quant
from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.codec.layout import LayerLayout

__all__ = ["Ops", "ReferenceOps", "padded", "levels_of", "codes_of"]


def padded(n: int) -> int:
    """Bytes of a code buffer of ``n`` values padded to whole blocks."""
    return -(-n // bitpack.BLOCK) * bitpack.BLOCK


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
        out[...] = quant.f32_to_bf16_bits(x, self.xp).reshape(out.shape)

    def from_bf16(self, bits: Any, out: Any) -> None:
        """fp32 ``out [H,T,D]`` (heads may be strided) from bfloat16 bit patterns."""
        out[...] = quant.bf16_bits_to_f32(bits, self.xp).reshape(out.shape)

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
        s, z = quant.group_params(lo, hi, levels, config.split, config.bits, xp, kind.upper())
        scale[...] = s
        zero[...] = z
        inv, z32 = quant.inverse(s, xp), z.astype(xp.float32)
        if config.scheme is Scheme.INT8:
            self.quantize(x, inv, z32, group, kind, levels, outs[0].reshape(x.shape))
            return
        n = x.size
        codes = xp.zeros(padded(n), dtype=xp.uint8)
        self.quantize(x, inv, z32, group, kind, levels, codes[:n].reshape(x.shape))
        self.cut_planes(codes, config, outs)

    def cut_planes(self, codes: Any, config: CodecConfig, outs: Sequence[Any]) -> None:
        """Padded 8-bit ``codes`` -> the packed regions of ``config``'s planes (``outs``, one per
        plane of its plane table; None for a plane that is not wanted)."""
        xp = self.xp
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
        offset = quant.prefix_offset(layout.split, layout.bits, 8 - shift)
        ends = self.end_codes(values, shift, group, kind) if quant.occ_mean(layout.split, 8 - shift) else None
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
        fn = quant.group_minmax_k if kind == "k" else quant.group_minmax_v
        return fn(x, group, self.xp)

    def _expand(self, p: Any, group: int, kind: str, shape: tuple[int, ...]) -> Any:
        if kind == "k":
            return quant.expand_k(p, group, shape[1], self.xp)
        return quant.expand_v(p, group, shape[2], self.xp)

    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        e = functools.partial(self._expand, group=group, kind=kind, shape=x.shape)
        out[...] = quant.quantize(x, e(inv), e(zero), levels, self.xp)

    def end_codes(self, values: Any, shift: int, group: int, kind: str) -> tuple[Any, Any]:
        return quant.end_codes(values, shift, group, kind, self.xp)

    def dequant(
        self, values: Any, shift: int, offset: float, ends: tuple[Any, Any] | None, scale: Any, zero: Any,
        group: int, kind: str, out: Any,
    ) -> None:
        e = functools.partial(self._expand, group=group, kind=kind, shape=values.shape)
        wide = None if ends is None else (e(ends[0]), e(ends[1]))
        out[...] = quant.dequantize(values, shift, offset, e(scale), e(zero), self.xp, wide)

    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        a, r = bitpack.split(codes, bits, self.xp)
        anchor[...] = a
        residual[...] = r

    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        codes[...] = bitpack.merge(anchor, residual, codes.size, bits, self.xp)

    def pack(self, values: Any, width: int, packed: Any) -> None:
        packed[...] = bitpack.pack(values, width, self.xp)

    def unpack(self, packed: Any, width: int, values: Any) -> None:
        values[...] = bitpack.unpack(packed, values.size, width, self.xp)
