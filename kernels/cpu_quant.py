"""Numba CPU kernels for group quantization: the fast twins of
``lynx_decode.codec.quant`` (same arithmetic, one IEEE fp32 operation at a
time, no fused multiply-add, so results match the NumPy reference bit for bit).
The occ-mean end codes of a prefix (:func:`end_codes_k` / :func:`end_codes_v`)
are serial ``nogil`` kernels: one cheap pass, not worth a thread-pool barrier.

Importing this module imports numba; nothing is compiled until first use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["minmax_k", "minmax_v", "quantize_k", "quantize_v", "dequant_k", "dequant_v", "end_inset",
           "end_codes_k", "end_codes_v"]

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


# ---- occ-mean: end bins of a prefix rebuilt by their occupancy ------------------------------


@njit(inline="always", cache=True)
def end_inset(n, rbits):  # pragma: no cover - compiled
    """fp32 ``fp32((n-1) * (2**r - 1)) / fp32(2n)`` (``n == 0``: 0, never read):
    ``codec.quant.end_inset``, one correctly rounded division of exact integers."""
    m = max(np.int32(n), np.int32(1))
    return np.float32(np.int32((m - 1) * ((1 << rbits) - 1))) / np.float32(np.int32(2 * m))


@njit(nogil=True, cache=True)
def end_codes_k(values, shift, group, lo, hi):  # pragma: no cover - compiled
    """occ-mean codes of prefix values ``values [H,T,D]`` (``q >> shift``) per K group
    (channel over ``group`` tokens): lo/hi [H,G,D] = inset(n_lo), 255 - inset(n_hi)."""
    heads, tokens, dim = values.shape
    groups = lo.shape[1]
    top = np.uint8(255 >> shift)
    nlo = np.empty(dim, np.int32)
    nhi = np.empty(dim, np.int32)
    for h in range(heads):
        for g in range(groups):
            nlo[:] = 0
            nhi[:] = 0
            for t in range(g * group, min(tokens, (g + 1) * group)):
                row = values[h, t]
                for d in range(dim):
                    nlo[d] += np.int32(row[d] == 0)
                    nhi[d] += np.int32(row[d] == top)
            for d in range(dim):
                lo[h, g, d] = end_inset(nlo[d], shift)
                hi[h, g, d] = np.float32(255) - end_inset(nhi[d], shift)


@njit(nogil=True, cache=True)
def end_codes_v(values, shift, group, lo, hi):  # pragma: no cover - compiled
    """As :func:`end_codes_k` per V group (token over ``group`` channels), lo/hi [H,T,G]."""
    heads, tokens, dim = values.shape
    groups = lo.shape[2]
    top = np.uint8(255 >> shift)
    for h in range(heads):
        for t in range(tokens):
            row = values[h, t]
            for g in range(groups):
                vs = row[g * group : min(dim, (g + 1) * group)]
                nlo = np.int32(0)
                nhi = np.int32(0)
                for d in range(vs.size):
                    nlo += np.int32(vs[d] == 0)
                    nhi += np.int32(vs[d] == top)
                lo[h, t, g] = end_inset(nlo, shift)
                hi[h, t, g] = np.float32(255) - end_inset(nhi, shift)


@njit(inline="always", cache=True)
def _end_code(v, mult, offset, top, lo, hi):  # pragma: no cover - compiled
    # the code of prefix value v: v * mult + offset; with occ-mean (top >= 0) the end bins
    # (v == 0, v == top) at their group's lo / hi code
    code = np.float32(np.float32(v) * mult) + offset
    if top < 0:
        return code
    code = hi if v == top else code
    return lo if v == 0 else code


@njit(parallel=True, cache=True)
def dequant_k(values, mult, offset, top, lo, hi, scale, zero, group, out):  # pragma: no cover - compiled
    """out = code * scale + zero in fp32, K params [H,G,D]: code = values * mult + offset,
    except, when ``top >= 0`` (occ-mean), the end bins (0 and ``top``) at their group's
    lo/hi code (``lo``/``hi`` shaped like the params; ignored when ``top < 0``)."""
    heads, tokens, dim = values.shape
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        g = t // group
        for d in range(dim):
            code = _end_code(values[h, t, d], mult, offset, top, lo[h, g, d], hi[h, g, d])
            out[h, t, d] = code * scale[h, g, d] + zero[h, g, d]


@njit(parallel=True, cache=True)
def dequant_v(values, mult, offset, top, lo, hi, scale, zero, group, out):  # pragma: no cover - compiled
    """As :func:`dequant_k` with V params [H,T,G]."""
    heads, tokens, dim = values.shape
    groups = scale.shape[2]
    for ht in prange(heads * tokens):
        h = ht // tokens
        t = ht % tokens
        for g in range(groups):
            s = scale[h, t, g]
            z = zero[h, t, g]
            lg = lo[h, t, g]
            hg = hi[h, t, g]
            for d in range(g * group, min(dim, (g + 1) * group)):
                code = _end_code(values[h, t, d], mult, offset, top, lg, hg)
                out[h, t, d] = code * s + z
