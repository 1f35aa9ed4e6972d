"""The NumPy reference defines the format: packing round-trips, the split is
exact, and reconstruction errors stay within the documented bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_decode import codec_pack as pk
from lynx_decode import codec_quant as qt
from lynx_decode.codec import decode_layer, encode_layer, int8_codes
from lynx_decode.codec_config import Backend, CodecConfig, Scheme, Split, Stream
from lynx_decode.codec_layout import LayerLayout
from tests.unit._codec_cases import cases

SETTINGS = settings(max_examples=40, deadline=None)


def test_pack_layout_by_hand() -> None:
    # 64 values: word i holds values 8i..8i+7; 4-bit packed word m, byte k = v[2m][k] | v[2m+1][k] << 4
    values = (np.arange(64) % 16).astype(np.uint8)
    packed = pk.pack(values, 4, np)
    assert packed.size == 32
    words = values.reshape(8, 8)
    for m in range(4):
        for k in range(8):
            assert packed[8 * m + k] == words[2 * m, k] | (words[2 * m + 1, k] << 4)
    # 3-bit: lane k's 24-bit integer sum_i v[i][k] << 3i, bytes m = 0..2 in packed word m
    values = np.random.default_rng(0).integers(0, 8, 64).astype(np.uint8)
    packed = pk.pack(values, 3, np).reshape(3, 8)
    words = values.reshape(8, 8)
    for k in range(8):
        lane = sum(int(words[i, k]) << (3 * i) for i in range(8))
        assert [packed[m, k] for m in range(3)] == [(lane >> (8 * m)) & 0xFF for m in range(3)]


@given(n=st.integers(1, 700), width=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_pack_round_trip_and_size(n: int, width: int, seed: int) -> None:
    values = np.random.default_rng(seed).integers(0, 1 << width, n).astype(np.uint8)
    packed = pk.pack(values, width, np)
    assert packed.size == pk.packed_size(n, width) == -(-n // 64) * 8 * width
    np.testing.assert_array_equal(pk.unpack(packed, n, width, np), values)


@given(n=st.integers(1, 700), bits=st.integers(2, 6), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_merge_of_split_is_the_codes(n: int, bits: int, seed: int) -> None:
    codes = np.random.default_rng(seed).integers(0, 256, n).astype(np.uint8)
    anchor, residual = pk.split(codes, bits, np)
    assert anchor.size == pk.packed_size(n, bits) and residual.size == pk.packed_size(n, 8 - bits)
    np.testing.assert_array_equal(pk.merge(anchor, residual, n, bits, np), codes)
    np.testing.assert_array_equal(pk.unpack(anchor, n, bits, np), codes >> (8 - bits))


def _expanded(layout: LayerLayout, anchor: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    def region(r: str) -> np.ndarray:
        reg = layout.region(f"{name}_{r}")
        return anchor[reg.offset : reg.offset + reg.size].view(np.float16).reshape(reg.shape).astype(np.float32)

    if name == "k":
        return (qt.expand_k(region("scale"), layout.k_group, layout.tokens, np),
                qt.expand_k(region("zero"), layout.k_group, layout.tokens, np))
    return (qt.expand_v(region("scale"), layout.v_group, layout.head_dim, np),
            qt.expand_v(region("zero"), layout.v_group, layout.head_dim, np))


def _slack(x: np.ndarray, zero: np.ndarray, scale: np.ndarray, levels: int) -> np.ndarray:
    return 2.0**-20 * (np.abs(x) + np.abs(zero) + levels * scale) + 1e-30


@given(case=cases())
@SETTINGS
def test_error_bounds(case) -> None:
    """INT8: |x - x_hat| <= s/2; anchor-only: <= s * 2**(r-1) (MSB, centre) or
    s * 2**(r-1) + s/2 (ROUNDED); all up to fp32 rounding."""
    enc = encode_layer(*case.inputs(), case.config, backend=Backend.NUMPY)
    anchor = enc.buffers[Stream.ANCHOR]
    full = decode_layer(enc.layout, anchor, enc.buffers[Stream.RESIDUAL], backend=Backend.NUMPY)
    coarse = decode_layer(enc.layout, anchor, backend=Backend.NUMPY)
    r = 8 - case.config.bits
    anchor_steps = 2 ** (r - 1) + (0.5 if case.config.split is Split.ROUNDED else 0.0)
    for name, x, x_full, x_anchor in zip("kv", case.exact_inputs(), full, coarse):
        scale, zero = _expanded(enc.layout, anchor, name)
        slack = _slack(x, zero, scale, 255)
        assert np.all(np.abs(x - x_full) <= scale / 2 + slack)
        assert np.all(np.abs(x - x_anchor) <= scale * anchor_steps + slack)


@given(case=cases(schemes=(Scheme.INT4,)))
@SETTINGS
def test_int4_error_bound(case) -> None:
    enc = encode_layer(*case.inputs(), case.config, backend=Backend.NUMPY)
    anchor = enc.buffers[Stream.ANCHOR]
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
    a, r = lynx.buffers[Stream.ANCHOR], lynx.buffers[Stream.RESIDUAL]
    a8 = int8.buffers[Stream.ANCHOR]
    for got, want in zip(int8_codes(lynx.layout, a, r, backend=Backend.NUMPY),
                         int8_codes(int8.layout, a8, backend=Backend.NUMPY)):
        np.testing.assert_array_equal(got, want)
    # merge(anchor, residual) of the packed regions is the INT8 codes, bit for bit
    for name, want in zip("kv", int8_codes(int8.layout, a8, backend=Backend.NUMPY)):
        ra, rr = lynx.layout.region(f"{name}_data"), lynx.layout.region(f"{name}_residual")
        merged = pk.merge(a[ra.offset : ra.offset + ra.size], r[rr.offset : rr.offset + rr.size], want.size, c.bits, np)
        np.testing.assert_array_equal(merged.reshape(want.shape), want)
    for got, want in zip(decode_layer(lynx.layout, a, r, backend=Backend.NUMPY),
                         decode_layer(int8.layout, a8, backend=Backend.NUMPY)):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_msb_split_anchor_is_top_bits_and_centre_reconstruction() -> None:
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 64, 64)).astype(np.float32)
    cfg = CodecConfig(bits=4)
    enc = encode_layer(k, k, cfg, backend=Backend.NUMPY)
    kq, _ = int8_codes(enc.layout, enc.buffers[Stream.ANCHOR], enc.buffers[Stream.RESIDUAL], backend=Backend.NUMPY)
    k_anchor, _ = decode_layer(enc.layout, enc.buffers[Stream.ANCHOR], backend=Backend.NUMPY)
    scale, zero = _expanded(enc.layout, enc.buffers[Stream.ANCHOR], "k")
    want = ((kq >> 4).astype(np.float32) * 16 + np.float32(7.5)) * scale + zero
    np.testing.assert_array_equal(k_anchor, want)


def test_rounded_split_anchor_equals_a_b_bit_quantizer() -> None:
    # ROUNDED: anchor-only levels span [min, max] of each group in 2**b - 1 steps (up to fp16 params)
    x = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(1, 64, 1).repeat(4, axis=2)
    enc = encode_layer(x, x, CodecConfig(bits=3, split=Split.ROUNDED), backend=Backend.NUMPY)
    k_anchor, _ = decode_layer(enc.layout, enc.buffers[Stream.ANCHOR], backend=Backend.NUMPY)
    levels = np.unique(k_anchor[0, :, 0])
    assert levels.size == 8
    np.testing.assert_allclose(levels, np.linspace(-1, 1, 8), atol=2e-3)


def test_bf16_round_trip_and_rounding() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, np.inf, -np.inf, 1e-40], dtype=np.float32)
    bits = qt.f32_to_bf16_bits(x, np)
    back = qt.bf16_bits_to_f32(bits, np)
    np.testing.assert_array_equal(back[[0, 3, 5, 6]], x[[0, 3, 5, 6]])
    assert back[1] == 1.0  # tie rounds to even
    assert back[2] == np.float32(1.015625)
    assert np.isnan(qt.bf16_bits_to_f32(qt.f32_to_bf16_bits(np.array([np.nan], np.float32), np), np))[0]


@pytest.mark.parametrize("value", [-70000.0, 1e5])
def test_fp16_param_rounding_is_directed(value: float) -> None:
    lo = np.array([value, 0.1, -0.1, 0.0, 1e-9], dtype=np.float32)
    down = qt._f16_down(lo, np)
    up = qt._f16_up(lo, np)
    finite = np.isfinite(down)
    assert np.all(down.astype(np.float32)[finite] <= lo[finite])
    assert np.all(up.astype(np.float32)[np.isfinite(up)] >= lo[np.isfinite(up)])
    assert np.all(down.astype(np.float32)[1:] <= lo[1:]) and np.all(up.astype(np.float32)[1:] >= lo[1:])
