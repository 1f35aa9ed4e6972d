"""lynx_kernels.cpu_pack on whole blocks equals the reference packing, for every width."""

from __future__ import annotations

import numpy as np
import pytest

from lynx_decode.codec import pack
from lynx_kernels import cpu_codec, cpu_pack


@pytest.mark.parametrize("bits", cpu_pack.SPLIT_WIDTHS)
def test_split_merge_unpack_match_reference(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 256, 64 * 37).astype(np.uint8)
    anchor, residual = pack.split(codes, bits, np)
    a = np.full_like(anchor, 0xAA)
    r = np.full_like(residual, 0xAA)
    cpu_pack.split_kernel(bits)(codes.view(np.uint64), a.view(np.uint64), r.view(np.uint64))
    np.testing.assert_array_equal(a, anchor)
    np.testing.assert_array_equal(r, residual)
    merged = np.zeros_like(codes)
    cpu_pack.merge_kernel(bits)(anchor.view(np.uint64), residual.view(np.uint64), merged.view(np.uint64))
    np.testing.assert_array_equal(merged, codes)
    top = np.zeros_like(codes)
    cpu_pack.unpack_kernel(bits)(anchor.view(np.uint64), top.view(np.uint64))
    np.testing.assert_array_equal(top, codes >> (8 - bits))


@pytest.mark.parametrize("width", cpu_pack.WIDTHS)
def test_pack_unpack_match_reference(width: int) -> None:
    values = np.random.default_rng(width).integers(0, 1 << width, 64 * 5).astype(np.uint8)
    packed = np.zeros(pack.packed_size(values.size, width), np.uint8)
    cpu_pack.pack_kernel(width)(values.view(np.uint64), packed.view(np.uint64))
    np.testing.assert_array_equal(packed, pack.pack(values, width, np))
    back = np.zeros_like(values)
    cpu_pack.unpack_kernel(width)(packed.view(np.uint64), back.view(np.uint64))
    np.testing.assert_array_equal(back, values)


def test_split_handles_extreme_codes() -> None:
    for fill in (0x00, 0xFF, 0x80, 0x7F):
        codes = np.full(64, fill, np.uint8)
        for bits in cpu_pack.SPLIT_WIDTHS:
            a = np.zeros(8 * bits, np.uint8)
            r = np.zeros(8 * (8 - bits), np.uint8)
            cpu_pack.split_kernel(bits)(codes.view(np.uint64), a.view(np.uint64), r.view(np.uint64))
            ra, rr = pack.split(codes, bits, np)
            np.testing.assert_array_equal(a, ra)
            np.testing.assert_array_equal(r, rr)


def test_fp16_conversions_match_numpy() -> None:
    # every fp16 bit pattern to fp32, and fp32 to fp16 (round to nearest even) on every
    # 97th fp32 bit pattern plus the rounding boundaries around each fp16 value
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(h.size, np.float32)
    cpu_codec.f16_value(h, got)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    centres = want[~nan].view(np.uint32).astype(np.int64)
    near = (centres[:, None] + np.arange(-4, 5)[None, :] * (1 << 12)).ravel()  # ties and neighbours (normal range)
    sweep = np.arange(0, 1 << 32, 97, dtype=np.int64)
    bits = np.concatenate([sweep, near[(near >= 0) & (near < 1 << 32)]]).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    out = np.empty(x.size, np.uint16)
    cpu_codec.f16_bits(x, out)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out, x.astype(np.float16).view(np.uint16))
