"""The Numba backend produces the NumPy reference's bytes exactly: every plane
buffer (packed planes, scales, zeros) and every decoded output, for every plane
split and every prefix of its planes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from lynx_decode.codec import decode_layer, encode_layer, int8_codes
from lynx_decode.codec.config import Backend, CodecConfig, Scheme
from tests.unit._codec_cases import cases


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@given(case=cases(schemes=tuple(Scheme)))
@settings(max_examples=60, deadline=None)
def test_numba_matches_reference_byte_for_byte(case) -> None:
    k, v = case.inputs()
    ref = encode_layer(k, v, case.config, backend=Backend.NUMPY)
    fast = encode_layer(k, v, case.config, backend=Backend.NUMBA)
    assert ref.layout == fast.layout
    for stream in range(ref.layout.num_planes):
        _same_bits(fast.buffers[stream], ref.buffers[stream])
    bufs = [ref.buffers[p] for p in range(ref.layout.num_planes)]
    for n in range(1, len(bufs) + 1):  # every prefix of the planes
        res = bufs[:n]
        for dtype in (np.float32, np.float16):
            want = decode_layer(ref.layout, *res, dtype=dtype, backend=Backend.NUMPY)
            got = decode_layer(ref.layout, *res, dtype=dtype, backend=Backend.NUMBA)
            for g, w in zip(got, want):
                _same_bits(g, w)
        # straight into a cache with headroom: heads apart, each head's [T, D] block contiguous
        heads, tokens, dim = ref.layout.shape
        for backend in (Backend.NUMPY, Backend.NUMBA):
            store = np.full((2, heads, tokens + 3, dim), np.float32(7.0))
            got = decode_layer(ref.layout, *res, out_k=store[0, :, :tokens], out_v=store[1, :, :tokens],
                               backend=backend)
            want = decode_layer(ref.layout, *res, backend=Backend.NUMPY)
            for g, w in zip(got, want):
                _same_bits(np.ascontiguousarray(g), w)
            assert (store[:, :, tokens:] == np.float32(7.0)).all(), "headroom was written"
    if case.config.scheme in (Scheme.INT8, Scheme.LYNX):
        want_codes = int8_codes(ref.layout, *bufs, backend=Backend.NUMPY)
        for g, w in zip(int8_codes(ref.layout, *bufs, backend=Backend.NUMBA), want_codes):
            _same_bits(g, w)


def test_signed_zeros_give_the_same_bytes() -> None:
    # a min/max reduction may return -0.0 or +0.0 depending on its order; the stored
    # fp16 zero points must not (regression: Numba and NumPy once differed here)
    k = np.zeros((1, 128, 8), np.float32)
    k[0, ::2] = -0.0
    v = k[:, ::-1].copy()
    for backend in (Backend.NUMPY, Backend.NUMBA):
        enc = encode_layer(k, v, backend=backend)
        zero = enc.layout.region("k_zero")
        stored = enc.buffers[0][zero.offset : zero.offset + zero.size].view(np.uint16)
        assert not stored.any(), backend  # +0.0 everywhere


def test_occ_mean_counts_past_a_byte() -> None:
    # the fused kernels count a K group's end-bin members in byte counters, 255 rows at a
    # time: groups of 600 tokens, ~270..570 of them in the bottom (even channels) or top
    # (odd channels) bin
    rng = np.random.default_rng(5)
    heads, tokens, dim = 2, 1300, 16
    k = rng.standard_normal((heads, tokens, dim)).astype(np.float32)
    crowd = rng.random((heads, tokens, dim)) < np.linspace(0.45, 0.95, dim)
    k = np.where(crowd, np.where(np.arange(dim) % 2 == 0, np.float32(-3.0), np.float32(3.0)), k).astype(np.float32)
    v = np.ascontiguousarray(k.transpose(0, 2, 1).reshape(heads, tokens, dim))
    for planes in ((2, 6), (4, 4), (3, 2, 3)):
        config = CodecConfig(planes=planes, k_group=600, v_group=dim)
        enc = encode_layer(k, v, config, backend=Backend.NUMPY)
        bufs = [enc.buffers[p] for p in range(enc.layout.num_planes)]
        for n in range(1, len(bufs)):
            want = decode_layer(enc.layout, *bufs[:n], backend=Backend.NUMPY)
            for g, w in zip(decode_layer(enc.layout, *bufs[:n], backend=Backend.NUMBA), want):
                _same_bits(g, w)
