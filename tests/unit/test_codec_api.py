"""The codec's public API: streams and wire sizes per scheme, decoding into
caller-provided outputs, torch inputs, backend choice, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lynx_decode
from lynx_decode import Backend, CodecConfig, LayerLayout, Scheme, decode_layer, encode_layer
from lynx_decode.codec import int8_codes, lynx_from_int8
from lynx_decode.codec.config import Split, int8_source
from lynx_decode.errors import CodecError, LayoutError
from lynx_transport.errors import BackendError

H, T, D = 3, 130, 64


@pytest.fixture(scope="module")
def kv() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.standard_normal((H, T, D)).astype(np.float32), rng.standard_normal((H, T, D)).astype(np.float32)


N = H * T * D  # 24,960 values per tensor, a whole number of 64-value blocks
PARAMS = 2 * 2 * (H * -(-T // 64) * D + H * T)  # fp16 scale + zero for K [H, 3, D] and V [H, T, 1]


@pytest.mark.parametrize(
    ("scheme", "anchor_payload", "residual_payload"),
    [
        (Scheme.BF16, 2 * 2 * N, 0),
        (Scheme.FP16, 2 * 2 * N, 0),
        (Scheme.INT8, 2 * N + PARAMS, 0),
        (Scheme.INT4, 2 * N // 2 + PARAMS, 0),
        (Scheme.LYNX, 2 * N // 2 + PARAMS, 2 * N // 2),
    ],
)
def test_streams_and_wire_sizes(kv, scheme: Scheme, anchor_payload: int, residual_payload: int) -> None:
    enc = encode_layer(*kv, CodecConfig(scheme))
    assert set(enc.buffers) == ({0, 1} if scheme is Scheme.LYNX else {0})
    for stream, buf in enc.buffers.items():
        assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous
        assert buf.size == enc.wire_bytes(stream) == enc.layout.plane_size(stream)
        payload = anchor_payload if stream == 0 else residual_payload
        regions = [r for r in enc.layout.regions if r.plane == stream]
        assert sum(r.size for r in regions) == payload
        assert payload <= enc.wire_bytes(stream) < payload + 64 * len(regions)  # alignment padding only
    assert enc.wire_bytes() == sum(buf.size for buf in enc.buffers.values())


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.NUMBA])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("split", list(Split))
@pytest.mark.parametrize("tokens", [1, 63, T])
def test_one_plane_at_a_time_gives_the_same_bytes(kv, backend: Backend, bits: int, split: Split,
                                                  tokens: int) -> None:
    k, v = (x[:, :tokens].copy() for x in kv)
    for config in (CodecConfig(Scheme.LYNX, bits=bits, split=split),
                   CodecConfig(Scheme.LYNX, planes=(bits, *([1] * (8 - bits))), split=split)):
        every = encode_layer(k, v, config, backend=backend)
        for plane in range(len(config.planes)):
            one = encode_layer(k, v, config, backend=backend, planes=[plane])
            assert set(one.buffers) == {plane}
            assert np.array_equal(one.buffers[plane], every.buffers[plane])


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.NUMBA])
@pytest.mark.parametrize("planes", [(4, 4), (3, 5), (2, 6), (6, 2), (2, 2, 4), (3, 1, 1, 3)])
@pytest.mark.parametrize("tokens", [1, 63, T])
def test_a_split_cut_from_int8_codes_is_its_encoding_byte_for_byte(kv, backend: Backend, planes: tuple[int, ...],
                                                                     tokens: int) -> None:
    """A prefill node holds INT8 and cuts any split from it as it sends: the planes must be the
    split's own encoding, whole or a plane at a time (tails of a partial 64-value block included)."""
    k, v = (x[:, :tokens].copy() for x in kv)
    config = CodecConfig(Scheme.LYNX, planes=planes, k_group=32)
    source = int8_source(config)
    assert source == CodecConfig(Scheme.INT8, k_group=32)
    int8 = encode_layer(k, v, source, backend=backend)
    want = encode_layer(k, v, config, backend=backend)
    cut = lynx_from_int8(int8, config, backend=backend)
    assert cut.layout == want.layout and set(cut.buffers) == set(want.buffers)
    for plane in want.buffers:
        assert np.array_equal(cut.buffers[plane], want.buffers[plane]), plane
        one = lynx_from_int8(int8, config, planes=[plane], backend=backend)
        assert set(one.buffers) == {plane} and np.array_equal(one.buffers[plane], want.buffers[plane])


def test_only_an_msb_split_is_cut_from_the_int8_form_with_its_groups(kv) -> None:
    int8 = encode_layer(*kv, CodecConfig(Scheme.INT8))
    assert int8_source(CodecConfig(Scheme.INT8)) is None and int8_source(CodecConfig(Scheme.BF16)) is None
    rounded = CodecConfig(Scheme.LYNX, split=Split.ROUNDED)
    assert int8_source(rounded) is None  # its grid's scales depend on the anchor width
    with pytest.raises(CodecError, match="MSB grid"):
        lynx_from_int8(int8, rounded)
    with pytest.raises(CodecError, match="groups 64/64"):  # another grouping's codes are other codes
        lynx_from_int8(int8, CodecConfig(Scheme.LYNX, v_group=32))
    with pytest.raises(CodecError, match="is not the INT8 form"):
        lynx_from_int8(encode_layer(*kv, CodecConfig(Scheme.INT4)), CodecConfig(Scheme.LYNX))


def test_planes_must_be_ones_the_scheme_has(kv) -> None:
    for config, bad in ((CodecConfig(Scheme.INT8), [1]), (CodecConfig(), []),
                        (CodecConfig(), ["anchor"]), (CodecConfig(planes=(2, 2, 4)), [3])):
        with pytest.raises(CodecError, match="planes must be"):
            encode_layer(*kv, config, planes=bad)
    only = encode_layer(*kv, CodecConfig(Scheme.INT4), planes=[0])
    assert np.array_equal(only.buffers[0],
                          encode_layer(*kv, CodecConfig(Scheme.INT4)).buffers[0])


def test_anchor_stream_is_about_half_of_int8(kv) -> None:
    lynx = encode_layer(*kv, CodecConfig(bits=4))
    int8 = encode_layer(*kv, CodecConfig(Scheme.INT8))
    int4 = encode_layer(*kv, CodecConfig(Scheme.INT4))
    assert lynx.wire_bytes(0) == int4.wire_bytes(0)
    assert lynx.wire_bytes() == int8.wire_bytes()


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.NUMBA])
def test_decode_into_out_arrays_and_torch_tensors(kv, backend: Backend) -> None:
    enc = encode_layer(*kv, backend=backend)
    a, r = enc.buffers[0], enc.buffers[1]
    want_k, want_v = decode_layer(enc.layout, a, r, backend=backend)
    out_k = np.empty((H, T, D), np.float32)
    out_v = np.empty((H, T, D), np.float32)
    got_k, got_v = decode_layer(enc.layout, a, r, out_k=out_k, out_v=out_v, backend=backend)
    assert got_k is out_k and got_v is out_v
    np.testing.assert_array_equal(out_k, want_k)
    np.testing.assert_array_equal(out_v, want_v)
    cache = torch.zeros((1, H, T, D), dtype=torch.float32)  # a model cache slab [batch, heads, T, D]
    decode_layer(enc.layout, bytes(a), bytes(r), out_k=cache[0], out_v=torch.zeros(H, T, D, dtype=torch.float16),
                 backend=backend)
    np.testing.assert_array_equal(cache[0].numpy(), want_k)
    half_k, _ = decode_layer(enc.layout, a, r, dtype=np.float16, backend=backend)
    assert half_k.dtype == np.float16
    np.testing.assert_array_equal(half_k, want_k.astype(np.float16))


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.NUMBA])
@pytest.mark.parametrize("scheme", list(Scheme))
def test_decode_into_a_cache_with_headroom(kv, backend: Backend, scheme: Scheme) -> None:
    from lynx_decode.model.buffers import KVBuffers, KVShape

    enc = encode_layer(*kv, CodecConfig(scheme), backend=backend)
    a, r = enc.buffers[0], enc.buffers.get(1)
    want = decode_layer(enc.layout, a, r, backend=Backend.NUMPY)
    cache = KVBuffers(KVShape(2, H, T, D), headroom=5)
    k, v = cache.layer(1)
    assert not k.flags.c_contiguous
    got = decode_layer(enc.layout, a, r, out_k=k, out_v=v, backend=backend)
    assert got[0] is k and got[1] is v
    cache.mark_written(1)
    np.testing.assert_array_equal(cache.keys[1], want[0])
    np.testing.assert_array_equal(cache.values[1], want[1])
    assert not cache.storage_keys[:, :, T:].any() and not cache.storage_keys[0].any()
    torch_k = torch.zeros((H, T + 2, D))[:, :T]  # a torch view with headroom
    decode_layer(enc.layout, a, r, out_k=torch_k, out_v=torch.zeros(H, T, D, dtype=torch.float16)[:, :, :],
                 backend=backend)
    np.testing.assert_array_equal(torch_k.numpy(), want[0])


def test_strided_outputs_that_are_not_per_head_blocks_are_refused(kv) -> None:
    enc = encode_layer(*kv)
    a = enc.buffers[0]
    bad = {
        "overlapping heads": np.lib.stride_tricks.as_strided(np.empty(H * T * D, np.float32), (H, T, D),
                                                             (4 * D, 4 * D, 4)),
        "strided tokens": np.empty((H, 2 * T, D), np.float32)[:, ::2],
        "strided channels": np.empty((H, T, 2 * D), np.float32)[:, :, ::2],
        "reversed heads": np.empty((H, T, D), np.float32)[::-1],
    }
    for what, out in bad.items():
        with pytest.raises(CodecError, match="heads are each C-contiguous"):
            decode_layer(enc.layout, a, out_k=out)
        assert what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_inputs_match_numpy(kv, dtype) -> None:
    k, v = (torch.from_numpy(x).to(dtype) for x in kv)
    enc = encode_layer(k, v, backend=Backend.NUMPY)
    ref = encode_layer(k.float().numpy(), v.float().numpy(), backend=Backend.NUMPY)
    for stream in enc.buffers:
        np.testing.assert_array_equal(enc.buffers[stream], ref.buffers[stream])


def test_bf16_passthrough_is_lossless_for_bf16_input(kv) -> None:
    k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in kv)
    enc = encode_layer(k, v, CodecConfig(Scheme.BF16))
    got_k, _ = decode_layer(enc.layout, enc.buffers[0])
    np.testing.assert_array_equal(got_k, k.float().numpy())


def test_auto_picks_numba_for_numpy_and_refuses_bad_requests(kv) -> None:
    from lynx_decode.codec.backends import NumbaOps, select

    assert isinstance(select(Backend.AUTO, np), NumbaOps)
    with pytest.raises(BackendError):  # no GPU here (or no CuPy): an explicit request must fail loudly
        encode_layer(*kv, backend=Backend.CUPY)
    with pytest.raises(CodecError, match="Backend"):
        encode_layer(*kv, backend="numba")


def test_int8_codes_only_for_int8_and_lynx(kv) -> None:
    enc = encode_layer(*kv, CodecConfig(Scheme.INT4))
    with pytest.raises(CodecError, match="no 8-bit codes"):
        int8_codes(enc.layout, enc.buffers[0])
    lynx = encode_layer(*kv)
    with pytest.raises(CodecError, match="need all 2 plane buffers"):
        int8_codes(lynx.layout, lynx.buffers[0])
    k8, v8 = int8_codes(lynx.layout, lynx.buffers[0], lynx.buffers[1])
    assert k8.dtype == np.uint8 and k8.shape == (H, T, D)
    assert v8.dtype == np.uint8 and v8.shape == (H, T, D)


# ---- bad input: each names the problem ------------------------------------


def test_non_contiguous_inputs(kv) -> None:
    k, v = kv
    with pytest.raises(CodecError, match="K is not C-contiguous"):
        encode_layer(k.transpose(0, 2, 1).copy().transpose(0, 2, 1), v)
    with pytest.raises(CodecError, match="V is not contiguous"):
        encode_layer(torch.from_numpy(k), torch.from_numpy(v).transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.parametrize("dtype", [np.float64, np.int8, np.uint8, np.complex64])
def test_unsupported_dtype(kv, dtype) -> None:
    with pytest.raises(CodecError, match="unsupported dtype"):
        encode_layer(kv[0].astype(dtype), kv[1])
    with pytest.raises(CodecError, match="unsupported dtype"):
        encode_layer(torch.zeros((1, 2, 3), dtype=torch.float64), torch.zeros((1, 2, 3), dtype=torch.float64))


def test_mismatched_shapes_and_bad_rank(kv) -> None:
    with pytest.raises(CodecError, match="shapes differ"):
        encode_layer(kv[0], kv[1][:, :-1].copy())
    with pytest.raises(CodecError, match=r"\[kv_heads, tokens, head_dim\]"):
        encode_layer(kv[0][None], kv[1][None])
    with pytest.raises(CodecError, match="empty"):
        encode_layer(np.zeros((3, 0, 64), np.float32), np.zeros((3, 0, 64), np.float32))
    with pytest.raises(CodecError, match="NumPy or CuPy array"):
        encode_layer([[[1.0]]], [[[1.0]]])


@pytest.mark.parametrize("bits", [0, 1, 7, 8, -3, True, 4.0])
def test_bits_out_of_range(bits) -> None:
    with pytest.raises(CodecError, match="bits"):
        CodecConfig(bits=bits)


@pytest.mark.parametrize("field", ["k_group", "v_group"])
def test_bad_group(field) -> None:
    with pytest.raises(CodecError, match=field):
        CodecConfig(**{field: 0})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1e6])
@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.NUMBA])
def test_non_finite_or_out_of_fp16_range(kv, bad, backend) -> None:
    # the zero point (group minimum) must be an fp16 number
    k = kv[0].copy()
    k[1, 5, 7] = bad
    with pytest.raises(CodecError, match="K contains non-finite|fp16 range"):
        encode_layer(k, kv[1], backend=backend)


def test_fp16_passthrough_refuses_overflow(kv) -> None:
    v = kv[1].copy()
    v[0, 0, 0] = 1e6
    with pytest.raises(CodecError, match="V has values outside the fp16 range"):
        encode_layer(kv[0], v, CodecConfig(Scheme.FP16))
    encode_layer(kv[0], v, CodecConfig(Scheme.BF16))  # bf16 has the range


def test_decode_rejects_bad_buffers_and_outputs(kv) -> None:
    enc = encode_layer(*kv)
    a, r = enc.buffers[0], enc.buffers[1]
    with pytest.raises(CodecError, match="holds"):
        decode_layer(enc.layout, a[:-1], r)
    with pytest.raises(CodecError, match="1-D uint8"):
        decode_layer(enc.layout, a.view(np.uint16), r)
    with pytest.raises(CodecError, match="shape"):
        decode_layer(enc.layout, a, r, out_k=np.empty((H, T, D + 1), np.float32))
    with pytest.raises(CodecError, match="float32 or float16"):
        decode_layer(enc.layout, a, r, out_k=np.empty((H, T, D), np.float64))
    with pytest.raises(CodecError, match="writable"):
        decode_layer(enc.layout, a, r, out_k=np.empty((H, D, T), np.float32).transpose(0, 2, 1))
    with pytest.raises(CodecError, match="dtype"):
        decode_layer(enc.layout, a, r, dtype=np.int32)
    int8 = encode_layer(*kv, CodecConfig(Scheme.INT8))
    with pytest.raises(CodecError, match="has 1 plane"):
        decode_layer(int8.layout, int8.buffers[0], r)
    with pytest.raises(CodecError, match="prefix"):
        decode_layer(enc.layout, a, None, r)
    with pytest.raises(LayoutError):
        decode_layer(LayerLayout(Scheme.LYNX, (4, 4), enc.layout.split, H, T, D, 64, 64, enc.layout.regions[:-1]),
                     a, r)


def test_public_namespace() -> None:
    assert {"encode_layer", "decode_layer", "CodecConfig", "Scheme", "CacheLayout"} <= set(lynx_decode.__all__)


def test_concurrent_decodes_from_threads_agree(kv) -> None:
    from concurrent.futures import ThreadPoolExecutor

    enc = encode_layer(*kv)
    a, r = enc.buffers[0], enc.buffers[1]
    want = decode_layer(enc.layout, a, r)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: decode_layer(enc.layout, a, r), range(16)))
    for got in results:
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_whole_cache_in_one_buffer_per_stream(kv) -> None:
    from lynx_decode import CacheLayout

    configs = [CodecConfig(bits=4), CodecConfig(Scheme.INT8), CodecConfig(bits=3), CodecConfig(Scheme.BF16)]
    encoded = [encode_layer(kv[0] * (i + 1), kv[1], c) for i, c in enumerate(configs)]
    cache = CacheLayout.from_bytes(CacheLayout.of(e.layout for e in encoded).to_bytes())
    streams = {s: np.zeros(cache.plane_size(s), np.uint8) for s in range(cache.num_planes)}
    for i, e in enumerate(encoded):  # what the sender puts on the wire
        for s, buf in e.buffers.items():
            streams[s][slice(*cache.span(i, s))] = buf
    for i, e in enumerate(encoded):  # what the receiver decodes
        layer = cache.layers[i]
        anchor = streams[0][slice(*cache.span(i, 0))]
        residual = None
        if layer.num_planes > 1:
            residual = streams[1][slice(*cache.span(i, 1))]
        got = decode_layer(layer, anchor, residual)
        want = decode_layer(e.layout, e.buffers[0], e.buffers.get(1))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize(("planes", "needle"), [
    ("4,3", "sum to 7 bits"), ("4,5", "sum to 9 bits"), ("4,0,4", "at least 1 bit"),
    ("1,1,1,1,1,1,1,1,1", "9 planes, but there are only 8 lanes"), ("8", "at least 2 planes"),
    ("7,1", "anchor"), ("1,7", "anchor"), ("4,,4", "comma-separated"), ("four", "comma-separated"),
])
def test_a_bad_split_is_refused_with_the_reason(planes: str, needle: str) -> None:
    from lynx_decode.codec import parse_planes

    with pytest.raises(CodecError, match=needle):
        parse_planes(planes)
    parts = planes.split(",")
    if all(p.isdigit() for p in parts):  # the same split as a tuple, straight into the config
        with pytest.raises(CodecError):
            CodecConfig(planes=tuple(int(p) for p in parts))


def test_every_valid_split_parses_and_names_itself() -> None:
    from lynx_decode.codec import parse_planes
    from lynx_decode.codec.config import planes_name

    assert parse_planes("2,2,4") == (2, 2, 4) == CodecConfig(planes=(2, 2, 4)).planes
    assert CodecConfig(bits=3).planes == (3, 5) and CodecConfig(planes=(3, 5)).bits == 3
    assert [planes_name(p) for p in ((4, 4), (3, 5), (2, 2, 4))] == ["4", "3", "2.2.4"]
    with pytest.raises(CodecError, match="disagrees"):
        CodecConfig(bits=4, planes=(3, 5))
