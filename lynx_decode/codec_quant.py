"""Reference group quantization (defines the format; NumPy or CuPy arrays).

Grouping (KIVI-style): K is quantized per channel over groups of ``k_group``
tokens (scale/zero shape ``[heads, ceil(T/k_group), head_dim]``); V per token over
groups of ``v_group`` channels (shape ``[heads, T, ceil(head_dim/v_group)]``). The
last group may be partial.

Parameters for a group with fp32 extremes ``lo``/``hi`` and ``L`` levels (255 for
INT8/LYNX, 15 for INT4), all arithmetic in fp32, one IEEE operation at a time:

- zero ``z`` = ``lo`` (``Split.ROUNDED``: ``lo - 2**(r-1) * s_r`` with
  ``s_r = (hi - lo) / ((2**b - 1) * 2**r)``), rounded *down* to fp16;
- scale ``s`` = ``max(s_r, (hi - z) / L)`` (``s_r = 0`` unless ROUNDED), rounded *up*
  to fp16, so ``[lo, hi]`` lies inside ``[z, z + L*s]`` and codes never clip more
  than fp32 rounding;
- ``inv = 1 / s`` (0 where ``s == 0``); code ``q = clip(rint((x - z) * inv), 0, L)``;
- dequantization of a (possibly fractional) code ``c``: ``c * s + z``.

Error bounds (up to fp32 rounding, at most ``2**-21 * (|x| + |z| + L*s)``):
INT8 ``|x - x_hat| <= s/2``; anchor-only LYNX ``|x - x_hat| <= s * (2**r - 1)/2 + s/2``
(MSB) or ``s * 2**(r-1) + s/2`` (ROUNDED).
Non-finite inputs, and extremes outside the fp16 range, raise :class:`CodecError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lynx_decode.codec_config import Split
from lynx_decode.errors import CodecError

__all__ = [
    "group_minmax_k",
    "group_minmax_v",
    "group_params",
    "expand_k",
    "expand_v",
    "quantize",
    "inverse",
    "dequantize",
    "anchor_offset",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
]


def _groups(n: int, group: int) -> int:
    return -(-n // group)


def group_minmax_k(x: Any, group: int, xp: Any) -> tuple[Any, Any]:
    """Per-channel extremes of fp32 ``x [H, T, D]`` over token groups: ``[H, G, D]``."""
    heads, tokens, dim = x.shape
    full = tokens // group
    los, his = [], []
    if full:
        body = x[:, : full * group].reshape(heads, full, group, dim)
        los.append(body.min(axis=2))
        his.append(body.max(axis=2))
    if tokens % group:
        tail = x[:, full * group :]
        los.append(tail.min(axis=1, keepdims=True))
        his.append(tail.max(axis=1, keepdims=True))
    return xp.concatenate(los, axis=1), xp.concatenate(his, axis=1)


def group_minmax_v(x: Any, group: int, xp: Any) -> tuple[Any, Any]:
    """Per-token extremes of fp32 ``x [H, T, D]`` over channel groups: ``[H, T, G]``."""
    heads, tokens, dim = x.shape
    full = dim // group
    los, his = [], []
    if full:
        body = x[:, :, : full * group].reshape(heads, tokens, full, group)
        los.append(body.min(axis=3))
        his.append(body.max(axis=3))
    if dim % group:
        tail = x[:, :, full * group :]
        los.append(tail.min(axis=2, keepdims=True))
        his.append(tail.max(axis=2, keepdims=True))
    return xp.concatenate(los, axis=2), xp.concatenate(his, axis=2)


def _f16_down(x32: Any, xp: Any) -> Any:
    """Largest fp16 <= x32 (NaN stays NaN, below -65504 gives -inf)."""
    with np.errstate(over="ignore"):
        h = x32.astype(xp.float16)
    bits = h.view(xp.uint16)
    prev = xp.where(
        bits == xp.uint16(0),
        xp.uint16(0x8001),
        xp.where(bits >= xp.uint16(0x8000), bits + xp.uint16(1), bits - xp.uint16(1)),
    )
    return xp.where(h.astype(xp.float32) > x32, prev, bits).astype(xp.uint16).view(xp.float16)


def _f16_up(x32: Any, xp: Any) -> Any:
    """Smallest fp16 >= x32 (NaN stays NaN, above 65504 gives +inf)."""
    with np.errstate(over="ignore"):
        h = x32.astype(xp.float16)
    bits = h.view(xp.uint16)
    nxt = xp.where(
        (bits == xp.uint16(0)) | (bits == xp.uint16(0x8000)),
        xp.uint16(1),
        xp.where(bits > xp.uint16(0x8000), bits - xp.uint16(1), bits + xp.uint16(1)),
    )
    return xp.where(h.astype(xp.float32) < x32, nxt, bits).astype(xp.uint16).view(xp.float16)


def group_params(lo: Any, hi: Any, levels: int, split: Split, bits: int, xp: Any, what: str) -> tuple[Any, Any]:
    """fp16 (scale, zero) for groups with fp32 extremes ``lo``/``hi`` (see module doc)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # overflow is detected below
        return _group_params(lo, hi, levels, split, bits, xp, what)


def _group_params(lo: Any, hi: Any, levels: int, split: Split, bits: int, xp: Any, what: str) -> tuple[Any, Any]:
    f32 = xp.float32
    # "+ 0" turns -0.0 into +0.0: which signed zero a min/max reduction returns depends
    # on its order, and the stored fp16 zero point must not depend on the backend
    lo = lo.astype(f32) + f32(0)
    hi = hi.astype(f32) + f32(0)
    if levels == 255 and split is Split.ROUNDED:
        rbits = 8 - bits
        s_r = (hi - lo) / f32(((1 << bits) - 1) << rbits)
        z_ideal = lo - f32(1 << (rbits - 1)) * s_r
    else:
        s_r = xp.zeros_like(lo)
        z_ideal = lo
    zero = _f16_down(z_ideal, xp)
    s_need = (hi - zero.astype(f32)) / f32(levels)
    scale = _f16_up(xp.maximum(s_r, s_need), xp)
    ok = xp.isfinite(scale) & xp.isfinite(zero)
    if not bool(ok.all()):
        raise CodecError(
            f"{what} contains non-finite values or values outside the fp16 range (|x| > 65504) "
            f"in {int((~ok).sum())} quantization group(s)"
        )
    return scale, zero


def expand_k(p: Any, group: int, tokens: int, xp: Any) -> Any:
    """Broadcast K params ``[H, G, D]`` to ``[H, T, D]``."""
    return xp.repeat(p, group, axis=1)[:, :tokens]


def expand_v(p: Any, group: int, dim: int, xp: Any) -> Any:
    """Broadcast V params ``[H, T, G]`` to ``[H, T, D]``."""
    return xp.repeat(p, group, axis=2)[:, :, :dim]


def inverse(scale: Any, xp: Any) -> Any:
    s = scale.astype(xp.float32)
    safe = xp.where(s > 0, s, xp.float32(1))
    return xp.where(s > 0, xp.float32(1) / safe, xp.float32(0)).astype(xp.float32)


def quantize(x: Any, inv: Any, zero: Any, levels: int, xp: Any) -> Any:
    """uint8 codes of fp32 ``x`` with fp32 ``inv``/``zero`` already broadcast to its shape."""
    y = xp.rint((x - zero) * inv)
    return xp.clip(y, xp.float32(0), xp.float32(levels)).astype(xp.uint8)


def anchor_offset(split: Split, bits: int) -> float:
    """Fractional code added to ``a << r`` for anchor-only reconstruction."""
    rbits = 8 - bits
    return float(1 << (rbits - 1)) if split is Split.ROUNDED else ((1 << rbits) - 1) / 2


def dequantize(values: Any, shift: int, offset: float, scale: Any, zero: Any, xp: Any) -> Any:
    """fp32 ``(values * 2**shift + offset) * scale + zero`` (scale/zero fp32, broadcast)."""
    f32 = xp.float32
    code = values.astype(f32) * f32(1 << shift) + f32(offset)
    return code * scale + zero


def bf16_bits_to_f32(bits: Any, xp: Any) -> Any:
    """bfloat16 bit patterns (uint16/int16) -> fp32, exactly."""
    return (bits.view(xp.uint16).astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def f32_to_bf16_bits(x: Any, xp: Any) -> Any:
    """fp32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = x.astype(xp.float32).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) >> xp.uint32(16)
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    quiet = (u >> xp.uint32(16)) | xp.uint32(0x0040)
    return xp.where(nan, quiet, rounded).astype(xp.uint16)
