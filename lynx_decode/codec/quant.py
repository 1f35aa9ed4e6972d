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

Reconstruction from a prefix of the planes: the top ``p`` bits of every code are
known, ``a = q >> r`` with ``r = 8 - p`` bits missing (``r = 0``: all planes, the
INT8 code itself). Decode-side only, from ``a`` and the group's scale/zero:

- ``Split.MSB`` (*occ-mean*): per quantization group (a partial last group counts
  only its real members) ``n_lo`` members have ``a == 0`` and ``n_hi`` have
  ``a == 2**p - 1``. Interior bins take the centre of the missing bits, code
  ``a * 2**r + (2**r - 1) / 2``; the bottom bin code ``inset(n_lo)``, the top bin
  ``255 - inset(n_hi)``, where ``inset(n) = fp32((n-1) * (2**r - 1)) / fp32(2n)``
  (one correctly rounded fp32 division of exact integers: :func:`end_inset`). An
  end bin of ``n`` members is rebuilt at ``(edge + (n-1) * centre) / n``: one of
  them is the group's extreme, at the edge (code 0 or 255) on this grid.
- ``Split.ROUNDED``: the anchor alone (``p == b``) gives the rounded b-bit level,
  code ``a * 2**r + 2**(r-1)``; longer prefixes the centre (its grid puts the
  group's extremes inside the end bins, not at their edges, so occ-mean's premise
  does not hold there).

Error bounds (up to fp32 rounding, at most ``2**-21 * (|x| + |z| + L*s)``):
INT8 ``|x - x_hat| <= s/2``. ``r`` bits missing: an interior bin (and every bin of
a ROUNDED prefix longer than the anchor) ``<= s * (2**r - 1)/2 + s/2 = s * 2**(r-1)``;
an MSB end bin ``<= s * (2**r - 1) + s/2`` (its code ``inset(n)`` lies in
``[0, (2**r - 1)/2)``, a member's code anywhere in ``[0, 2**r - 1]``: the bound
is met only by a lone member off the grid's edge, as when a narrow range far from
zero leaves the fp16 zero point well below the min; a lone member on the edge is
exact, INT8's ``s/2``); the ROUNDED anchor alone ``<= s * 2**(r-1) + s/2``.
Non-finite inputs, and extremes outside the fp16 range, raise :class:`CodecError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lynx_decode.codec.config import Split
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
    "prefix_offset",
    "occ_mean",
    "end_inset",
    "group_count_k",
    "group_count_v",
    "end_codes",
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


def prefix_offset(split: Split, bits: int, prefix_bits: int) -> float:
    """Fractional code added to ``a << r`` when only the top ``prefix_bits`` bits of a
    code are known (``r = 8 - prefix_bits``): the centre of the missing bits, or for
    ``Split.ROUNDED`` with exactly the anchor's ``bits`` the rounded b-bit level.
    With :func:`occ_mean` the end bins take :func:`end_codes` instead."""
    rbits = 8 - prefix_bits
    if rbits <= 0:
        return 0.0
    if split is Split.ROUNDED and prefix_bits == bits:
        return float(1 << (rbits - 1))
    return ((1 << rbits) - 1) / 2


def occ_mean(split: Split, prefix_bits: int) -> bool:
    """Whether a LYNX prefix of ``prefix_bits`` known bits rebuilds its end bins by
    occupancy (occ-mean, see the module doc): ``Split.MSB`` with bits missing."""
    return split is Split.MSB and prefix_bits < 8


def end_inset(n: Any, rbits: int, xp: Any) -> Any:
    """fp32 distance from the group's edge (in codes) at which an end bin holding
    ``n >= 1`` members is rebuilt, ``r = rbits`` bits missing:
    ``fp32((n-1) * (2**r - 1)) / fp32(2n)``. Both integers are exact in fp32 (groups
    hold at most 2**16 members) and the division is correctly rounded, so every
    backend gets the same bits. ``n == 0`` (an empty bin, never read) gives 0."""
    n = xp.maximum(xp.asarray(n).astype(xp.int32), xp.int32(1))
    num = ((n - xp.int32(1)) * xp.int32((1 << rbits) - 1)).astype(xp.float32)
    return num / (xp.int32(2) * n).astype(xp.float32)


def group_count_k(mask: Any, group: int, xp: Any) -> Any:
    """Per-channel counts of ``mask [H, T, D]`` (bool) over token groups: ``[H, G, D]`` int32."""
    heads, tokens, dim = mask.shape
    full = tokens // group
    parts = []
    if full:
        parts.append(mask[:, : full * group].reshape(heads, full, group, dim).sum(axis=2, dtype=xp.int32))
    if tokens % group:
        parts.append(mask[:, full * group :].sum(axis=1, keepdims=True, dtype=xp.int32))
    return xp.concatenate(parts, axis=1)


def group_count_v(mask: Any, group: int, xp: Any) -> Any:
    """Per-token counts of ``mask [H, T, D]`` (bool) over channel groups: ``[H, T, G]`` int32."""
    heads, tokens, dim = mask.shape
    full = dim // group
    parts = []
    if full:
        parts.append(mask[:, :, : full * group].reshape(heads, tokens, full, group).sum(axis=3, dtype=xp.int32))
    if dim % group:
        parts.append(mask[:, :, full * group :].sum(axis=2, keepdims=True, dtype=xp.int32))
    return xp.concatenate(parts, axis=2)


def end_codes(values: Any, shift: int, group: int, kind: str, xp: Any) -> tuple[Any, Any]:
    """occ-mean codes (fp32, group-shaped like the scales) of the bottom and top bins
    of prefix values ``values = q >> shift [H, T, D]``: ``inset(n_lo)`` and
    ``255 - inset(n_hi)`` (:func:`end_inset`), ``n_lo`` / ``n_hi`` the members of each
    group with ``values == 0`` / ``values == 255 >> shift`` (``kind`` 'k' or 'v')."""
    count = group_count_k if kind == "k" else group_count_v
    lo = end_inset(count(values == xp.uint8(0), group, xp), shift, xp)
    hi = xp.float32(255) - end_inset(count(values == xp.uint8(255 >> shift), group, xp), shift, xp)
    return lo, hi


def dequantize(values: Any, shift: int, offset: float, scale: Any, zero: Any, xp: Any,
               ends: tuple[Any, Any] | None = None) -> Any:
    """fp32 ``code * scale + zero`` with ``code = values * 2**shift + offset``, or with
    ``ends`` (occ-mean, fp32 ``(lo, hi)`` broadcast like scale/zero) ``lo`` where
    ``values == 0`` and ``hi`` where ``values == 255 >> shift``."""
    f32 = xp.float32
    code = values.astype(f32) * f32(1 << shift) + f32(offset)
    if ends is not None:
        lo, hi = ends
        code = xp.where(values == xp.uint8(0), lo, xp.where(values == xp.uint8(255 >> shift), hi, code))
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
