"""The NumPy reference defines the format: packing round-trips, the split is
exact, and reconstruction errors stay within the documented bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_decode.codec import decode_layer, encode_layer, int8_codes, pack, quant
from lynx_decode.codec.config import Backend, CodecConfig, Scheme, Split
from lynx_decode.codec.layout import LayerLayout, plane_region
from tests.unit._codec_cases import cases, plane_splits

SETTINGS = settings(max_examples=40, deadline=None)


def test_pack_layout_by_hand() -> None:
    # 64 values: word i holds values 8i..8i+7; 4-bit packed word m, byte k = v[2m][k] | v[2m+1][k] << 4
    values = (np.arange(64) % 16).astype(np.uint8)
    packed = pack.pack(values, 4, np)
    assert packed.size == 32
    words = values.reshape(8, 8)
    for m in range(4):
        for k in range(8):
            assert packed[8 * m + k] == words[2 * m, k] | (words[2 * m + 1, k] << 4)
    # 3-bit: lane k's 24-bit integer sum_i v[i][k] << 3i, bytes m = 0..2 in packed word m
    values = np.random.default_rng(0).integers(0, 8, 64).astype(np.uint8)
    packed = pack.pack(values, 3, np).reshape(3, 8)
    words = values.reshape(8, 8)
    for k in range(8):
        lane = sum(int(words[i, k]) << (3 * i) for i in range(8))
        assert [packed[m, k] for m in range(3)] == [(lane >> (8 * m)) & 0xFF for m in range(3)]


@given(n=st.integers(1, 700), width=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_pack_round_trip_and_size(n: int, width: int, seed: int) -> None:
    values = np.random.default_rng(seed).integers(0, 1 << width, n).astype(np.uint8)
    packed = pack.pack(values, width, np)
    assert packed.size == pack.packed_size(n, width) == -(-n // 64) * 8 * width
    np.testing.assert_array_equal(pack.unpack(packed, n, width, np), values)


@given(n=st.integers(1, 700), bits=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_merge_of_split_is_the_codes(n: int, bits: int, seed: int) -> None:
    codes = np.random.default_rng(seed).integers(0, 256, n).astype(np.uint8)
    anchor, residual = pack.split(codes, bits, np)
    assert anchor.size == pack.packed_size(n, bits) and residual.size == pack.packed_size(n, 8 - bits)
    np.testing.assert_array_equal(pack.merge(anchor, residual, n, bits, np), codes)
    np.testing.assert_array_equal(pack.unpack(anchor, n, bits, np), codes >> (8 - bits))


def _expanded(layout: LayerLayout, anchor: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    def region(r: str) -> np.ndarray:
        reg = layout.region(f"{name}_{r}")
        return anchor[reg.offset : reg.offset + reg.size].view(np.float16).reshape(reg.shape).astype(np.float32)

    if name == "k":
        return (quant.expand_k(region("scale"), layout.k_group, layout.tokens, np),
                quant.expand_k(region("zero"), layout.k_group, layout.tokens, np))
    return (quant.expand_v(region("scale"), layout.v_group, layout.head_dim, np),
            quant.expand_v(region("zero"), layout.v_group, layout.head_dim, np))


def _slack(x: np.ndarray, zero: np.ndarray, scale: np.ndarray, levels: int) -> np.ndarray:
    return 2.0**-20 * (np.abs(x) + np.abs(zero) + levels * scale) + 1e-30


@given(case=cases())
@SETTINGS
def test_error_bounds(case) -> None:
    """Each prefix of the planes, ``r`` bits missing (all planes, r = 0: INT8's s/2),
    up to fp32 rounding: interior bins ``|x - x_hat| <= s * 2**(r-1)`` (the centre);
    ``Split.MSB`` end bins (occ-mean) ``<= s * (2**r - 1) + s/2``; the anchor alone of
    a ``Split.ROUNDED`` grid ``<= s * 2**(r-1) + s/2`` in every bin, its longer
    prefixes the centre's ``s * 2**(r-1)``."""
    enc = encode_layer(*case.inputs(), case.config, backend=Backend.NUMPY)
    bufs = [enc.buffers[p] for p in range(enc.layout.num_planes)]
    codes = int8_codes(enc.layout, *bufs, backend=Backend.NUMPY)
    for plane in enc.layout.plane_table:
        decoded = decode_layer(enc.layout, *bufs[: plane.index + 1], backend=Backend.NUMPY)
        r = plane.shift
        rounded = case.config.split is Split.ROUNDED
        for name, x, x_hat, q in zip("kv", case.exact_inputs(), decoded, codes):
            scale, zero = _expanded(enc.layout, bufs[0], name)
            a = q >> r
            end = (a == 0) | (a == 255 >> r)
            if r == 0:
                steps = np.full(x.shape, 0.5)
            elif rounded:
                steps = np.full(x.shape, 2.0 ** (r - 1) + (0.5 if plane.index == 0 else 0.0))
            else:
                steps = np.where(end, 2.0**r - 1 + 0.5, 2.0 ** (r - 1))
            assert np.all(np.abs(x - x_hat) <= scale * steps + _slack(x, zero, scale, 255)), (name, plane)


def _group_ids(shape: tuple[int, int, int], kind: str, group: int) -> np.ndarray:
    """Per element of ``[H, T, D]``: the flat index of its quantization group
    (written independently of the codec's reshapes)."""
    _heads, tokens, dim = shape
    h, t, d = np.indices(shape)
    if kind == "k":
        return (h * -(-tokens // group) + t // group) * dim + d
    return (h * tokens + t) * -(-dim // group) + d // group


@given(heads=st.integers(1, 3), tokens=st.integers(1, 150), dim=st.sampled_from([1, 7, 16, 33, 64, 80]),
       k_group=st.sampled_from([1, 3, 16, 64, 100]), v_group=st.sampled_from([1, 5, 32, 64, 128]),
       planes=plane_splits(), seed=st.integers(0, 2**32 - 1), outliers=st.booleans())
@SETTINGS
def test_occ_mean_reproduces_a_lone_extreme(heads, tokens, dim, k_group, v_group, planes, seed, outliers) -> None:
    """A group's max alone in its top bin is rebuilt exactly as INT8 rebuilds it
    (code 255, bitwise), for every prefix of every ``Split.MSB`` split; likewise its
    min alone in the bottom bin when the min is on the grid's edge (code 0). The max
    is always at code 255 where the fp16 scale is a normal number (rounded up by
    less than 2**-10), which is checked too."""
    rng = np.random.default_rng(seed)
    shape = (heads, tokens, dim)
    spread = rng.choice([0.1, 1.0, 20.0], size=(1, 1, dim)) if outliers else 1.0
    k, v = ((rng.standard_normal(shape) * spread).astype(np.float32) for _ in range(2))
    config = CodecConfig(planes=planes, k_group=k_group, v_group=v_group)
    enc = encode_layer(k, v, config, backend=Backend.NUMPY)
    bufs = [enc.buffers[p] for p in range(enc.layout.num_planes)]
    full = decode_layer(enc.layout, *bufs, backend=Backend.NUMPY)
    codes = int8_codes(enc.layout, *bufs, backend=Backend.NUMPY)
    for i, name, x, group in ((0, "k", k, k_group), (1, "v", v, v_group)):
        gid = _group_ids(shape, name, group).ravel()
        groups = int(gid.max()) + 1
        gmax = np.full(groups, -np.inf, np.float32)
        gmin = np.full(groups, np.inf, np.float32)
        np.maximum.at(gmax, gid, x.ravel())
        np.minimum.at(gmin, gid, x.ravel())
        is_max = x.ravel() == gmax[gid]
        is_min = x.ravel() == gmin[gid]
        q = codes[i].ravel()
        scale, _zero = _expanded(enc.layout, bufs[0], name)
        normal = scale.ravel() >= np.float32(2.0**-14)
        assert np.all(q[is_max & normal] == 255), "the grid's top edge is the group's max"
        for plane in enc.layout.plane_table[:-1]:
            prefix = decode_layer(enc.layout, *bufs[: plane.index + 1], backend=Backend.NUMPY)[i].ravel()
            a = q >> plane.shift
            for edge, extreme, code in ((255 >> plane.shift, is_max, 255), (0, is_min, 0)):
                in_bin = np.bincount(gid, weights=a == edge, minlength=groups)[gid]
                lone = extreme & (in_bin == 1) & (q == code)
                np.testing.assert_array_equal(prefix[lone].view(np.uint32), full[i].ravel()[lone].view(np.uint32))


@given(case=cases(schemes=(Scheme.INT4,)))
@SETTINGS
def test_int4_error_bound(case) -> None:
    enc = encode_layer(*case.inputs(), case.config, backend=Backend.NUMPY)
    anchor = enc.buffers[0]
    for name, x, x_hat in zip("kv", case.exact_inputs(), decode_layer(enc.layout, anchor, backend=Backend.NUMPY)):
        scale, zero = _expanded(enc.layout, anchor, name)
        assert np.all(np.abs(x - x_hat) <= scale / 2 + _slack(x, zero, scale, 15))


@given(case=cases())
@SETTINGS
def test_anchor_plus_residual_is_exactly_int8(case) -> None:
    k, v = case.inputs()
    lynx = encode_layer(k, v, case.config, backend=Backend.NUMPY)
    c = case.config
    int8 = encode_layer(k, v, CodecConfig(Scheme.INT8, c.bits, c.k_group, c.v_group, c.split), backend=Backend.NUMPY)
    bufs = [lynx.buffers[p] for p in range(lynx.layout.num_planes)]
    a8 = int8.buffers[0]
    for got, want in zip(int8_codes(lynx.layout, *bufs, backend=Backend.NUMPY),
                         int8_codes(int8.layout, a8, backend=Backend.NUMPY)):
        np.testing.assert_array_equal(got, want)
    # the unpacked planes, shifted into place, are the INT8 codes, bit for bit
    for name, want in zip("kv", int8_codes(int8.layout, a8, backend=Backend.NUMPY)):
        merged = np.zeros(want.size, np.uint8)
        for plane, buf in zip(lynx.layout.plane_table, bufs):
            reg = lynx.layout.region(plane_region(name, plane.index))
            merged |= pack.unpack(buf[reg.offset : reg.offset + reg.size], want.size, plane.bits, np) << plane.shift
        np.testing.assert_array_equal(merged.reshape(want.shape), want)
    for got, want in zip(decode_layer(lynx.layout, *bufs, backend=Backend.NUMPY),
                         decode_layer(int8.layout, a8, backend=Backend.NUMPY)):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_msb_split_anchor_is_top_bits_and_occ_mean_reconstruction() -> None:
    # by hand: interior bins at the centre of the missing bits, an end bin of n members
    # at (edge + (n-1) * centre) / n of its group; partial last groups (K 100 tokens in
    # groups of 64, V 8 channels in groups of 5) count only their real members
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 100, 8)).astype(np.float32)
    for planes in ((4, 4), (2, 2, 4), (6, 1, 1)):
        cfg = CodecConfig(planes=planes, k_group=64, v_group=5)
        enc = encode_layer(x, x, cfg, backend=Backend.NUMPY)
        bufs = [enc.buffers[p] for p in range(enc.layout.num_planes)]
        codes = int8_codes(enc.layout, *bufs, backend=Backend.NUMPY)
        for plane in enc.layout.plane_table[:-1]:
            r = plane.shift
            got = decode_layer(enc.layout, *bufs[: plane.index + 1], backend=Backend.NUMPY)
            for i, (name, group) in enumerate((("k", 64), ("v", 5))):
                a = (codes[i] >> r).astype(np.int64)
                gid = _group_ids(x.shape, name, group)
                n_lo = np.maximum(np.bincount(gid.ravel(), weights=(a == 0).ravel())[gid], 1)  # 0: never read
                n_hi = np.maximum(np.bincount(gid.ravel(), weights=(a == 255 >> r).ravel())[gid], 1)
                code = (a * 2**r + ((2**r - 1) / 2)).astype(np.float32)
                lo = np.float32((n_lo - 1) * (2**r - 1)) / np.float32(2 * n_lo)
                code = np.where(a == 0, lo, code)
                code = np.where(a == 255 >> r, np.float32(255) - np.float32((n_hi - 1) * (2**r - 1))
                                / np.float32(2 * n_hi), code)
                scale, zero = _expanded(enc.layout, bufs[0], name)
                np.testing.assert_array_equal(got[i], code.astype(np.float32) * scale + zero, err_msg=f"{planes} {r}")


def test_rounded_split_anchor_equals_a_b_bit_quantizer() -> None:
    # ROUNDED: anchor-only levels span [min, max] of each group in 2**b - 1 steps (up to fp16 params)
    x = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(1, 64, 1).repeat(4, axis=2)
    enc = encode_layer(x, x, CodecConfig(bits=3, split=Split.ROUNDED), backend=Backend.NUMPY)
    k_anchor, _ = decode_layer(enc.layout, enc.buffers[0], backend=Backend.NUMPY)
    levels = np.unique(k_anchor[0, :, 0])
    assert levels.size == 8
    np.testing.assert_allclose(levels, np.linspace(-1, 1, 8), atol=2e-3)


def test_bf16_round_trip_and_rounding() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, np.inf, -np.inf, 1e-40], dtype=np.float32)
    bits = quant.f32_to_bf16_bits(x, np)
    back = quant.bf16_bits_to_f32(bits, np)
    np.testing.assert_array_equal(back[[0, 3, 5, 6]], x[[0, 3, 5, 6]])
    assert back[1] == 1.0  # tie rounds to even
    assert back[2] == np.float32(1.015625)
    assert np.isnan(quant.bf16_bits_to_f32(quant.f32_to_bf16_bits(np.array([np.nan], np.float32), np), np))[0]


@pytest.mark.parametrize("value", [-70000.0, 1e5])
def test_fp16_param_rounding_is_directed(value: float) -> None:
    lo = np.array([value, 0.1, -0.1, 0.0, 1e-9], dtype=np.float32)
    down = quant._f16_down(lo, np)
    up = quant._f16_up(lo, np)
    finite = np.isfinite(down)
    assert np.all(down.astype(np.float32)[finite] <= lo[finite])
    assert np.all(up.astype(np.float32)[np.isfinite(up)] >= lo[np.isfinite(up)])
    assert np.all(down.astype(np.float32)[1:] <= lo[1:]) and np.all(up.astype(np.float32)[1:] >= lo[1:])
