"""Fused per-layer Numba kernels: one pass from fp32 K or V to the layer's wire
regions (encode), and one pass from the regions to fp32 (decode). Same format,
bit for bit, as the NumPy reference (``lynx_decode.codec.quant`` /
``codec_pack``); fp32 arithmetic one IEEE operation at a time, no FMA.

Why fused and serial. A layer is several MB per tensor; an unfused path would
run one ``parallel=True`` kernel per stage (min/max, quantize, split, ...), each
re-reading the tensor, plus NumPy temporaries for the fp16 parameters, and each
parallel launch waits at a barrier for a worker thread, which on a loaded host
costs a scheduler slice per launch (docs/design.md, "Measured facts"). These
kernels instead walk the tensor once, in *units* that stay in
L1/L2 (one K group of ``k_group`` tokens, or a run of V rows, of one head):

- encode: group extremes -> fp16 scale/zero (rounded down/up exactly like the
  reference) -> codes into a small window -> every whole 64-value block of the
  window is packed (INT4), split (LYNX) or, for INT8, the codes go straight to
  the wire region;
- decode: the unit's blocks are unpacked (or merged with the residual) into the
  window, then dequantized straight into the output, whose heads may sit
  ``head_stride`` values apart (a model cache with headroom). An anchor-only
  decode with occ-mean (``DEC_ANCHOR_OCC``, ``Split.MSB``) first counts, in the
  window, each group's anchors in the bottom and top bins (K: one count per
  channel over the unit's rows; V: one per row and channel group), then rebuilds
  those bins at their occupancy codes (``codec.quant`` module doc).

Kernels run on the calling thread (``nogil``: no lock, no thread pool, safe to
call from several threads at once). ``mode`` selects the scheme; the packing
width is a literal in each branch, so shifts and masks fold to immediates.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lynx_kernels._nt import f16_round, f16_widen
from lynx_kernels.cpu_pack import _pack_word, _unpack_word
from lynx_kernels.cpu_quant import _end_code, end_inset

__all__ = [
    "ENC_INT8", "ENC_INT4", "ENC_LYNX", "ENC_ANCHOR", "ENC_RESIDUAL", "DEC_INT8", "DEC_INT4", "DEC_ANCHOR", "DEC_FULL",
    "DEC_ANCHOR_OCC",
    "encode_k", "encode_v", "decode_k", "decode_v", "to_bf16", "from_bf16", "f16_bits", "f16_value",
]  # fmt: skip

ENC_INT8, ENC_INT4, ENC_LYNX = 0, 1, 2
#: LYNX, one stream at a time: the anchors (with the scales), or the residuals alone
#: (scale/zero still written, into whatever arrays are passed). Same bits as ENC_LYNX.
ENC_ANCHOR, ENC_RESIDUAL = 3, 4
DEC_INT8, DEC_INT4, DEC_ANCHOR, DEC_FULL = 0, 1, 2, 3
#: The anchors alone with occ-mean end bins (``Split.MSB``); ``DEC_ANCHOR`` takes
#: every bin at ``a * mult + offset`` (``Split.ROUNDED``'s b-bit levels).
DEC_ANCHOR_OCC = 4

_REP = 0x0101010101010101
_UNIT = 4096  # values per V unit (whole rows); a K unit is one token group


@njit(inline="always", cache=True)
def _window(values):  # pragma: no cover - compiled
    # bytes of a unit's window: a partial block either side, whole uint64 words
    return (values + 128 + 63) // 64 * 64


# ---- fp16 <-> fp32 (NumPy's astype semantics) --------------------------------------------


@njit(inline="always", cache=True)
def _to_f16(f):  # pragma: no cover - compiled
    # fp16 bits (int64) of float32 f, round to nearest even; overflow -> inf
    return np.int64(f16_round(f))


@njit(inline="always", cache=True)
def _from_f16(h):  # pragma: no cover - compiled
    # float32 value of fp16 bits h (exact)
    return f16_widen(np.uint16(h))


@njit(inline="always", cache=True)
def _f16_down(z):  # pragma: no cover - compiled
    h = _to_f16(z)
    if _from_f16(h) > z:
        h = 0x8001 if h == 0 else (h + 1 if h >= 0x8000 else h - 1)
    return h


@njit(inline="always", cache=True)
def _f16_up(z):  # pragma: no cover - compiled
    h = _to_f16(z)
    if _from_f16(h) < z:
        h = 1 if (h == 0 or h == 0x8000) else (h - 1 if h > 0x8000 else h + 1)
    return h


@njit(cache=True)
def f16_bits(x, out):  # pragma: no cover - compiled
    """``out[i]`` = fp16 bits of float32 ``x[i]`` (for the tests)."""
    for i in range(x.size):
        out[i] = _to_f16(x[i])


@njit(cache=True)
def f16_value(h, out):  # pragma: no cover - compiled
    """``out[i]`` = float32 value of fp16 bits ``h[i]`` (for the tests)."""
    for i in range(h.size):
        out[i] = _from_f16(h[i])


@njit(inline="always", cache=True)
def _params(lo, hi, levels, rounded, bits):  # pragma: no cover - compiled
    # (scale bits, zero bits, inv, zero, finite) of one group: codec_quant.group_params
    f32 = np.float32
    lo = f32(lo + f32(0))
    hi = f32(hi + f32(0))
    s_r = f32(0)
    z = lo
    if rounded:
        rb = 8 - bits
        s_r = f32((hi - lo) / f32(((1 << bits) - 1) << rb))
        z = f32(lo - f32(f32(1 << (rb - 1)) * s_r))
    zb = _f16_down(z)
    zf = _from_f16(zb)
    s_need = f32(f32(hi - zf) / levels)
    sb = _f16_up(s_need if s_need > s_r else s_r)
    s = _from_f16(sb)
    inv = f32(f32(1) / s) if s > f32(0) else f32(0)
    finite = (sb & 0x7C00) != 0x7C00 and (zb & 0x7C00) != 0x7C00
    return sb, zb, inv, zf, finite


@njit(inline="always", cache=True)
def _code(x, z, inv, levels):  # pragma: no cover - compiled
    # clip(rint((x - z) * inv), 0, levels) as selects (vectorizes; NaN never gets here)
    y = np.rint(np.float32(np.float32(x - z) * inv))
    y = levels if y > levels else y
    y = np.float32(0) if y < np.float32(0) else y
    return np.uint8(np.int32(y))


@njit(fastmath={"nnan", "nsz", "reassoc"}, cache=True)
def _row_extremes(xs, dim, group, lo, hi):  # pragma: no cover - compiled
    # V group extremes of finite rows xs [rows*dim] -> lo, hi [rows*groups]. Finite
    # inputs only (checked before); which signed zero wins is free (params add +0.0).
    # Only comparisons here, so these flags change no value: they let min/max vectorize.
    groups = -(-dim // group)
    for t in range(xs.size // dim):
        xr = xs[t * dim : (t + 1) * dim]
        for g in range(groups):
            d0 = g * group
            a = xr[d0]
            b = xr[d0]
            xg = xr[d0 : min(dim, d0 + group)]
            for d in range(xg.size):
                a = min(a, xg[d])
                b = max(b, xg[d])
            lo[t * groups + g] = a
            hi[t * groups + g] = b


@njit(inline="always", cache=True)
def _nonfinite(xu):  # pragma: no cover - compiled
    # whether fp32 bit patterns xu hold an inf or NaN (an integer sum: vectorizes)
    m = np.uint32(0x7F800000)
    acc = np.uint32(0)
    for i in range(xu.size):
        acc += np.uint32((xu[i] & m) == m)
    return acc != np.uint32(0)


# ---- packing a window of whole blocks -----------------------------------------------------


@njit(inline="always", cache=True)
def _pack_blocks(win, nb, dst, b0, w, shift):  # pragma: no cover - compiled
    # the w bits above the lowest ``shift`` of each value
    mask = np.uint64((1 << w) - 1) * np.uint64(_REP)
    for j in range(nb):
        for m in range(w):
            dst[(b0 + j) * w + m] = _pack_word(win, j * 8, shift, mask, w, m)


@njit(inline="always", cache=True)
def _split_blocks(win, nb, anchor, residual, b0, wa, wr):  # pragma: no cover - compiled
    amask = np.uint64((1 << wa) - 1) * np.uint64(_REP)
    rmask = np.uint64((1 << wr) - 1) * np.uint64(_REP)
    for j in range(nb):
        for m in range(wa):
            anchor[(b0 + j) * wa + m] = _pack_word(win, j * 8, wr, amask, wa, m)
        for m in range(wr):
            residual[(b0 + j) * wr + m] = _pack_word(win, j * 8, 0, rmask, wr, m)


@njit(inline="always", cache=True)
def _emit(win, nb, mode, bits, anchor, residual, b0):  # pragma: no cover - compiled
    # pack nb whole blocks of the window as blocks b0.. of the wire regions
    if mode == ENC_INT4:
        _pack_blocks(win, nb, anchor, b0, 4, 0)
    elif mode == ENC_ANCHOR:
        _one_stream_blocks(win, nb, bits, anchor, b0, True)
    elif mode == ENC_RESIDUAL:
        _one_stream_blocks(win, nb, bits, residual, b0, False)
    elif bits == 4:
        _split_blocks(win, nb, anchor, residual, b0, 4, 4)
    elif bits == 2:
        _split_blocks(win, nb, anchor, residual, b0, 2, 6)
    elif bits == 3:
        _split_blocks(win, nb, anchor, residual, b0, 3, 5)
    elif bits == 5:
        _split_blocks(win, nb, anchor, residual, b0, 5, 3)
    else:
        _split_blocks(win, nb, anchor, residual, b0, 6, 2)


@njit(inline="always", cache=True)
def _one_stream_blocks(win, nb, bits, dst, b0, anchor):  # pragma: no cover - compiled
    # LYNX, one stream (ENC_ANCHOR / ENC_RESIDUAL): the top ``bits`` of each code,
    # or the low ``8 - bits``; the width is a literal in each branch
    w = bits if anchor else 8 - bits
    shift = 8 - bits if anchor else 0
    if w == 4:
        _pack_blocks(win, nb, dst, b0, 4, shift)
    elif w == 2:
        _pack_blocks(win, nb, dst, b0, 2, shift)
    elif w == 3:
        _pack_blocks(win, nb, dst, b0, 3, shift)
    elif w == 5:
        _pack_blocks(win, nb, dst, b0, 5, shift)
    else:
        _pack_blocks(win, nb, dst, b0, 6, shift)


@njit(cache=True)
def _flush(win, fill, mode, bits, anchor, residual, b0, last):  # pragma: no cover - compiled
    # pack the window's whole blocks (all of it, zero-padded, when last); keep the rest.
    # Not inlined: one call per unit, and every packing width is compiled once, not per
    # call site and kernel
    if last and fill % 64:
        win[fill : fill + 64 - fill % 64] = 0
        fill += 64 - fill % 64
    nb = fill // 64
    if nb:
        _emit(win.view(np.uint64), nb, mode, bits, anchor, residual, b0)
        keep = fill - nb * 64
        win[:keep] = win[nb * 64 : fill]
        fill = keep
    return fill, b0 + nb


# ---- encode -------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def encode_k(  # pragma: no cover - compiled
    x, tokens, dim, group, levels, rounded, bits, mode, scale, zero, data, residual
):
    """K (per channel over ``group`` tokens) of flat fp32 ``x`` [H*T*D] -> fp16 bits
    ``scale``/``zero`` [H*G*D] and ``data`` (INT8 codes, or packed words of the INT4
    / anchor region) and ``residual`` (LYNX). Returns (non-finite groups of x,
    non-finite parameters)."""
    heads = x.size // (tokens * dim)
    groups = -(-tokens // group)
    lv = np.float32(levels)
    lo = np.empty(dim, np.float32)
    hi = np.empty(dim, np.float32)
    inv = np.empty(dim, np.float32)
    zf = np.empty(dim, np.float32)
    win = np.empty(_window(min(group, tokens) * dim), np.uint8)
    a64 = data.view(np.uint64) if mode != ENC_INT8 else data[:0].view(np.uint64)
    r64 = residual.view(np.uint64)
    fill = 0
    b0 = 0
    bad_x = 0
    bad_p = 0
    xu = x.view(np.uint32)
    for h in range(heads):
        for g in range(groups):
            t0 = g * group
            rows = min(tokens, t0 + group) - t0
            base = (h * tokens + t0) * dim
            if _nonfinite(xu[base : base + rows * dim]):
                bad_x += 1
                continue
            lo[:] = x[base : base + dim]
            hi[:] = x[base : base + dim]
            for t in range(1, rows):
                xr = x[base + t * dim : base + (t + 1) * dim]
                for d in range(dim):
                    v = xr[d]
                    lo[d] = v if v < lo[d] else lo[d]
                    hi[d] = v if v > hi[d] else hi[d]
            p = (h * groups + g) * dim
            for d in range(dim):
                sb, zb, iv, z, ok = _params(lo[d], hi[d], lv, rounded, bits)
                scale[p + d] = sb
                zero[p + d] = zb
                inv[d] = iv
                zf[d] = z
                bad_p += not ok
            for t in range(rows):
                xr = x[base + t * dim : base + (t + 1) * dim]
                if mode == ENC_INT8:
                    cr = data[base + t * dim : base + (t + 1) * dim]
                else:
                    cr = win[fill + t * dim : fill + (t + 1) * dim]
                for d in range(dim):
                    cr[d] = _code(xr[d], zf[d], inv[d], lv)
            if mode != ENC_INT8:
                fill, b0 = _flush(win, fill + rows * dim, mode, bits, a64, r64, b0, False)
    if mode != ENC_INT8:
        _flush(win, fill, mode, bits, a64, r64, b0, True)
    return bad_x, bad_p


@njit(nogil=True, cache=True)
def encode_v(  # pragma: no cover - compiled
    x, tokens, dim, group, levels, rounded, bits, mode, scale, zero, data, residual
):
    """As :func:`encode_k` for V (per token over ``group`` channels; params
    [H*T*Gv]). Counts non-finite rows of x."""
    heads = x.size // (tokens * dim)
    groups = -(-dim // group)
    lv = np.float32(levels)
    unit = max(1, _UNIT // dim)
    win = np.empty(_window(min(unit, tokens) * dim), np.uint8)
    lo = np.empty(min(unit, tokens) * groups, np.float32)
    hi = np.empty(min(unit, tokens) * groups, np.float32)
    inv = np.empty(min(unit, tokens) * groups, np.float32)
    zf = np.empty(min(unit, tokens) * groups, np.float32)
    a64 = data.view(np.uint64) if mode != ENC_INT8 else data[:0].view(np.uint64)
    r64 = residual.view(np.uint64)
    fill = 0
    b0 = 0
    bad_x = 0
    bad_p = 0
    xu = x.view(np.uint32)
    for h in range(heads):
        for t0 in range(0, tokens, unit):
            rows = min(tokens, t0 + unit) - t0
            first = (h * tokens + t0) * dim
            if _nonfinite(xu[first : first + rows * dim]):
                for t in range(rows):
                    bad_x += _nonfinite(xu[first + t * dim : first + (t + 1) * dim])
                continue
            _row_extremes(x[first : first + rows * dim], dim, group, lo, hi)
            p = (h * tokens + t0) * groups
            for i in range(rows * groups):
                sb, zb, iv, z, ok = _params(lo[i], hi[i], lv, rounded, bits)
                scale[p + i] = sb
                zero[p + i] = zb
                inv[i] = iv
                zf[i] = z
                bad_p += not ok
            for t in range(rows):
                row = first + t * dim
                xr = x[row : row + dim]
                if mode == ENC_INT8:
                    cr = data[row : row + dim]
                else:
                    cr = win[fill + t * dim : fill + (t + 1) * dim]
                for g in range(groups):
                    z = zf[t * groups + g]
                    iv = inv[t * groups + g]
                    d0 = g * group
                    xs = xr[d0 : min(dim, d0 + group)]  # a slice per group: the loop vectorizes
                    cs = cr[d0 : min(dim, d0 + group)]
                    for d in range(xs.size):
                        cs[d] = _code(xs[d], z, iv, lv)
            if mode != ENC_INT8:
                fill, b0 = _flush(win, fill + rows * dim, mode, bits, a64, r64, b0, False)
    if mode != ENC_INT8:
        _flush(win, fill, mode, bits, a64, r64, b0, True)
    return bad_x, bad_p


# ---- decode -------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _unpack_blocks(src, b0, nb, win, w):  # pragma: no cover - compiled
    for j in range(nb):
        for i in range(8):
            win[j * 8 + i] = _unpack_word(src, (b0 + j) * w, w, i)


@njit(inline="always", cache=True)
def _merge_blocks(anchor, residual, b0, nb, win, wa, wr):  # pragma: no cover - compiled
    for j in range(nb):
        for i in range(8):
            high = _unpack_word(anchor, (b0 + j) * wa, wa, i) << np.uint64(wr)
            win[j * 8 + i] = high | _unpack_word(residual, (b0 + j) * wr, wr, i)


@njit(cache=True)
def _values(mode, bits, a64, r64, b0, nb, win):  # pragma: no cover - compiled
    # blocks b0 .. b0+nb-1 of the unit's 8-bit values (or anchors) into the window
    # (not inlined, like _flush)
    if mode == DEC_INT4:
        _unpack_blocks(a64, b0, nb, win, 4)
    elif mode in (DEC_ANCHOR, DEC_ANCHOR_OCC):
        if bits == 4:
            _unpack_blocks(a64, b0, nb, win, 4)
        elif bits == 2:
            _unpack_blocks(a64, b0, nb, win, 2)
        elif bits == 3:
            _unpack_blocks(a64, b0, nb, win, 3)
        elif bits == 5:
            _unpack_blocks(a64, b0, nb, win, 5)
        else:
            _unpack_blocks(a64, b0, nb, win, 6)
    elif bits == 4:
        _merge_blocks(a64, r64, b0, nb, win, 4, 4)
    elif bits == 2:
        _merge_blocks(a64, r64, b0, nb, win, 2, 6)
    elif bits == 3:
        _merge_blocks(a64, r64, b0, nb, win, 3, 5)
    elif bits == 5:
        _merge_blocks(a64, r64, b0, nb, win, 5, 3)
    else:
        _merge_blocks(a64, r64, b0, nb, win, 6, 2)


@njit(inline="always", cache=True)
def _source(mode, bits, data, a64, r64, win, base, count):  # pragma: no cover - compiled
    # (array, offset) holding the unit's values at [offset, offset + count)
    if mode == DEC_INT8:
        return data, base
    b0 = base // 64
    nb = (base + count + 63) // 64 - b0
    _values(mode, bits, a64, r64, b0, nb, win.view(np.uint64))
    return win, base - b0 * 64


@njit(inline="always", cache=True)
def _count_k(src, off, rows, dim, top, c8lo, c8hi, nlo, nhi):  # pragma: no cover - compiled
    # per channel, how many of the unit's rows hold anchor 0 / top: byte counters over
    # up to 255 rows at a time (four times the lanes of int32 ones), then widened
    nlo[:] = 0
    nhi[:] = 0
    for t0 in range(0, rows, 255):
        c8lo[:] = 0
        c8hi[:] = 0
        for t in range(t0, min(rows, t0 + 255)):
            vr = src[off + t * dim : off + (t + 1) * dim]
            for d in range(dim):
                c8lo[d] += vr[d] == 0
                c8hi[d] += vr[d] == top
        for d in range(dim):
            nlo[d] += c8lo[d]
            nhi[d] += c8hi[d]


@njit(nogil=True, cache=True)
def decode_k(  # pragma: no cover - compiled
    data, residual, tokens, dim, group, mode, bits, mult, offset, scale, zero, out, head_stride
):
    """``out[h*head_stride + t*D + d]`` = ``(value*mult + offset) * scale + zero`` of K
    (params [H*G*D] fp16 bits); ``DEC_ANCHOR_OCC``: the end bins at their group's
    occ-mean codes. ``data`` is the INT8 codes or the packed INT4 / anchor region,
    ``residual`` the packed residual (``DEC_FULL``)."""
    groups = -(-tokens // group)
    heads = scale.size // (groups * dim)
    s = np.empty(dim, np.float32)
    z = np.empty(dim, np.float32)
    nlo = np.empty(dim, np.int32)
    nhi = np.empty(dim, np.int32)
    c8lo = np.empty(dim, np.uint8)
    c8hi = np.empty(dim, np.uint8)
    lo = np.empty(dim, np.float32)
    hi = np.empty(dim, np.float32)
    top = np.uint8((1 << bits) - 1)
    rbits = 8 - bits
    win = np.empty(_window(min(group, tokens) * dim), np.uint8)
    a64 = data.view(np.uint64) if mode != DEC_INT8 else data[:0].view(np.uint64)
    r64 = residual.view(np.uint64)
    for h in range(heads):
        for g in range(groups):
            t0 = g * group
            rows = min(tokens, t0 + group) - t0
            base = (h * tokens + t0) * dim
            p = (h * groups + g) * dim
            for d in range(dim):
                s[d] = _from_f16(scale[p + d])
                z[d] = _from_f16(zero[p + d])
            src, off = _source(mode, bits, data, a64, r64, win, base, rows * dim)
            o = h * head_stride + t0 * dim
            if mode == DEC_ANCHOR_OCC:
                _count_k(src, off, rows, dim, top, c8lo, c8hi, nlo, nhi)
                for d in range(dim):
                    lo[d] = end_inset(nlo[d], rbits)
                    hi[d] = np.float32(255) - end_inset(nhi[d], rbits)
                for t in range(rows):
                    vr = src[off + t * dim : off + (t + 1) * dim]
                    orow = out[o + t * dim : o + (t + 1) * dim]
                    for d in range(dim):
                        code = _end_code(vr[d], mult, offset, top, lo[d], hi[d])
                        orow[d] = np.float32(code * s[d]) + z[d]
                continue
            for t in range(rows):
                vr = src[off + t * dim : off + (t + 1) * dim]
                orow = out[o + t * dim : o + (t + 1) * dim]
                for d in range(dim):
                    code = np.float32(np.float32(vr[d]) * mult) + offset
                    orow[d] = np.float32(code * s[d]) + z[d]


@njit(nogil=True, cache=True)
def decode_v(  # pragma: no cover - compiled
    data, residual, tokens, dim, group, mode, bits, mult, offset, scale, zero, out, head_stride
):
    """As :func:`decode_k` for V (params [H*T*Gv] fp16 bits)."""
    groups = -(-dim // group)
    heads = scale.size // (groups * tokens)
    top = np.uint8((1 << bits) - 1)
    rbits = 8 - bits
    unit = max(1, _UNIT // dim)
    win = np.empty(_window(min(unit, tokens) * dim), np.uint8)
    s = np.empty(min(unit, tokens) * groups, np.float32)
    z = np.empty(min(unit, tokens) * groups, np.float32)
    a64 = data.view(np.uint64) if mode != DEC_INT8 else data[:0].view(np.uint64)
    r64 = residual.view(np.uint64)
    for h in range(heads):
        for t0 in range(0, tokens, unit):
            rows = min(tokens, t0 + unit) - t0
            base = (h * tokens + t0) * dim
            src, off = _source(mode, bits, data, a64, r64, win, base, rows * dim)
            p = (h * tokens + t0) * groups
            for i in range(rows * groups):
                s[i] = _from_f16(scale[p + i])
                z[i] = _from_f16(zero[p + i])
            for t in range(rows):
                o = h * head_stride + (t0 + t) * dim
                vr = src[off + t * dim : off + (t + 1) * dim]
                orow = out[o : o + dim]
                for g in range(groups):
                    sg = s[t * groups + g]
                    zg = z[t * groups + g]
                    d0 = g * group
                    vs = vr[d0 : min(dim, d0 + group)]  # a slice per group: the loop vectorizes
                    os = orow[d0 : min(dim, d0 + group)]
                    if mode == DEC_ANCHOR_OCC:
                        nlo = np.int32(0)
                        nhi = np.int32(0)
                        for d in range(vs.size):
                            nlo += np.int32(vs[d] == 0)
                            nhi += np.int32(vs[d] == top)
                        lg = end_inset(nlo, rbits)
                        hg = np.float32(255) - end_inset(nhi, rbits)
                        for d in range(vs.size):
                            code = _end_code(vs[d], mult, offset, top, lg, hg)
                            os[d] = np.float32(code * sg) + zg
                        continue
                    for d in range(vs.size):
                        code = np.float32(np.float32(vs[d]) * mult) + offset
                        os[d] = np.float32(code * sg) + zg


# ---- bfloat16 passthrough ------------------------------------------------------------------


@njit(nogil=True, cache=True)
def to_bf16(x, out):  # pragma: no cover - compiled
    """bfloat16 bits of fp32 bit patterns ``x`` (uint32, flat): round to nearest even,
    NaN stays (quiet) NaN; codec_quant.f32_to_bf16_bits."""
    for i in range(x.size):
        u = x[i]
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = (u >> np.uint32(16)) | np.uint32(0x0040)
        else:
            out[i] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(nogil=True, cache=True)
def from_bf16(bits, tokens, dim, out, head_stride):  # pragma: no cover - compiled
    """fp32 bit patterns of bfloat16 ``bits`` [H*T*D] into ``out`` (uint32 view, heads
    ``head_stride`` apart), exactly."""
    per_head = tokens * dim
    for h in range(bits.size // per_head):
        src = bits[h * per_head : (h + 1) * per_head]
        dst = out[h * head_stride : h * head_stride + per_head]
        for i in range(per_head):
            dst[i] = np.uint32(src[i]) << np.uint32(16)
