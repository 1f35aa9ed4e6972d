"""Numba CPU kernels for group quantization: the fast twins of
``lynx_decode.codec._quant`` (same arithmetic, one IEEE fp32 operation at a
time, no fused multiply-add, so results match the NumPy reference bit for bit).

Importing this module imports numba; nothing is compiled until first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["minmax_k", "minmax_v", "quantize_k", "quantize_v", "dequant_k", "dequant_v"]

_BIG = np.float32(3.4028235e38)


@njit(parallel=True, cache=True)
def minmax_k(x, group, lo, hi, bad):  # pragma: no cover - compiled
    """Per-channel extremes over token groups: x [H,T,D] f32 -> lo, hi [H,G,D];
    ``bad[h*G + g]`` is set when the group holds NaN or inf."""
    heads, tokens, dim = x.shape
    groups = lo.shape[1]
    for hg in prange(heads * groups):
        h = hg // groups
        g = hg % groups
        t0 = g * group
        t1 = min(tokens, t0 + group)
        flag = False
        for d in range(dim):
            lo[h, g, d] = x[h, t0, d]
            hi[h, g, d] = x[h, t0, d]
        for t in range(t0, t1):
            for d in range(dim):
                v = x[h, t, d]
                lo[h, g, d] = min(lo[h, g, d], v)
                hi[h, g, d] = max(hi[h, g, d], v)
                flag |= not (abs(v) <= _BIG)
        bad[hg] = flag


@njit(parallel=True, cache=True)
def minmax_v(x, group, lo, hi, bad):  # pragma: no cover - compiled
    """Per-token extremes over channel groups: x [H,T,D] f32 -> lo, hi [H,T,G];
    ``bad[h*T + t]`` is set when the token holds NaN or inf."""
    heads, tokens, dim = x.shape
    groups = lo.shape[2]
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        flag = False
        for g in range(groups):
            d0 = g * group
            d1 = min(dim, d0 + group)
            a = x[h, t, d0]
            b = x[h, t, d0]
            for d in range(d0, d1):
                v = x[h, t, d]
                a = min(a, v)
                b = max(b, v)
                flag |= not (abs(v) <= _BIG)
            lo[h, t, g] = a
            hi[h, t, g] = b
        bad[ht] = flag


@njit(inline="always", cache=True)
def _code(x, z, inv, levels):  # pragma: no cover - compiled
    y = np.rint((x - z) * inv)
    return np.uint8(min(max(y, np.float32(0)), levels))


@njit(parallel=True, cache=True)
def quantize_k(x, inv, zero, group, levels, out):  # pragma: no cover - compiled
    """out[h,t,d] = clip(rint((x - zero) * inv), 0, levels), K params [H,G,D]."""
    heads, tokens, dim = x.shape
    lv = np.float32(levels)
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        g = t // group
        for d in range(dim):
            out[h, t, d] = _code(x[h, t, d], zero[h, g, d], inv[h, g, d], lv)


@njit(parallel=True, cache=True)
def quantize_v(x, inv, zero, group, levels, out):  # pragma: no cover - compiled
    """As :func:`quantize_k` with V params [H,T,G] (groups of channels)."""
    heads, tokens, dim = x.shape
    groups = inv.shape[2]
    lv = np.float32(levels)
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        for g in range(groups):
            z = zero[h, t, g]
            iv = inv[h, t, g]
            for d in range(g * group, min(dim, (g + 1) * group)):
                out[h, t, d] = _code(x[h, t, d], z, iv, lv)


@njit(parallel=True, cache=True)
def dequant_k(values, mult, offset, scale, zero, group, out):  # pragma: no cover - compiled
    """out = (values * mult + offset) * scale + zero in fp32, K params [H,G,D]."""
    heads, tokens, dim = values.shape
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        g = t // group
        for d in range(dim):
            code = np.float32(values[h, t, d]) * mult + offset
            out[h, t, d] = code * scale[h, g, d] + zero[h, g, d]


@njit(parallel=True, cache=True)
def dequant_v(values, mult, offset, scale, zero, group, out):  # pragma: no cover - compiled
    """As :func:`dequant_k` with V params [H,T,G]."""
    heads, tokens, dim = values.shape
    groups = scale.shape[2]
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        for g in range(groups):
            s = scale[h, t, g]
            z = zero[h, t, g]
            for d in range(g * group, min(dim, (g + 1) * group)):
                code = np.float32(values[h, t, d]) * mult + offset
                out[h, t, d] = code * s + z
