"""The Numba backend produces the NumPy reference's bytes exactly: every stream
buffer (anchors, residuals, scales, zeros) and every decoded output."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from lynx_decode.codec import decode_layer, encode_layer, int8_codes
from lynx_decode.codec_config import Backend, Scheme, Stream
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
    for stream in ref.layout.streams:
        _same_bits(fast.buffers[stream], ref.buffers[stream])
    anchor = ref.buffers[Stream.ANCHOR]
    residual = ref.buffers.get(Stream.RESIDUAL)
    variants = [None] if residual is None else [None, residual]
    for res in variants:
        for dtype in (np.float32, np.float16):
            want = decode_layer(ref.layout, anchor, res, dtype=dtype, backend=Backend.NUMPY)
            got = decode_layer(ref.layout, anchor, res, dtype=dtype, backend=Backend.NUMBA)
            for g, w in zip(got, want):
                _same_bits(g, w)
        # straight into a cache with headroom: heads apart, each head's [T, D] block contiguous
        heads, tokens, dim = ref.layout.shape
        for backend in (Backend.NUMPY, Backend.NUMBA):
            store = np.full((2, heads, tokens + 3, dim), np.float32(7.0))
            got = decode_layer(ref.layout, anchor, res, out_k=store[0, :, :tokens], out_v=store[1, :, :tokens],
                               backend=backend)
            want = decode_layer(ref.layout, anchor, res, backend=Backend.NUMPY)
            for g, w in zip(got, want):
                _same_bits(np.ascontiguousarray(g), w)
            assert (store[:, :, tokens:] == np.float32(7.0)).all(), "headroom was written"
    if case.config.scheme in (Scheme.INT8, Scheme.LYNX):
        want_codes = int8_codes(ref.layout, anchor, residual, backend=Backend.NUMPY)
        for g, w in zip(int8_codes(ref.layout, anchor, residual, backend=Backend.NUMBA), want_codes):
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
        stored = enc.buffers[Stream.ANCHOR][zero.offset : zero.offset + zero.size].view(np.uint16)
        assert not stored.any(), backend  # +0.0 everywhere
