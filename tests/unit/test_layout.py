"""Layout descriptors round-trip, and every inconsistent one is rejected with LayoutError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_decode.codec.config import CodecConfig, Scheme, Split
from lynx_decode.codec.layout import ALIGN, CacheLayout, LayerLayout
from lynx_decode.errors import CodecError, LayoutError

configs = st.builds(
    CodecConfig,
    scheme=st.sampled_from(list(Scheme)),
    bits=st.integers(2, 6),
    k_group=st.integers(1, 128),
    v_group=st.integers(1, 128),
    split=st.sampled_from(list(Split)),
)
layers = st.builds(LayerLayout.build, configs, st.integers(1, 8), st.integers(1, 5000), st.integers(1, 256))


def _cache() -> CacheLayout:
    return CacheLayout.of(
        [
            LayerLayout.build(CodecConfig(), 3, 2014, 64),
            LayerLayout.build(CodecConfig(Scheme.INT8), 3, 2014, 64),
            LayerLayout.build(CodecConfig(bits=3, k_group=32), 3, 2014, 64),
        ]
    )


@given(st.lists(layers, min_size=1, max_size=4))
@settings(max_examples=60, deadline=None)
def test_round_trip(items: list[LayerLayout]) -> None:
    cache = CacheLayout.of(items)
    data = cache.to_bytes()
    assert CacheLayout.from_bytes(data) == cache
    for i, layer in enumerate(cache.layers):
        for stream in range(layer.num_planes):
            assert cache.offset(i, stream) % ALIGN == 0
    for stream in range(cache.num_planes):
        ends = [cache.offset(i, stream) + layer.plane_size(stream)
                for i, layer in enumerate(cache.layers) if stream < layer.num_planes]
        assert cache.plane_size(stream) == max(ends, default=0)


def test_sizes_follow_shapes_and_bits() -> None:
    n = 3 * 2014 * 64
    lynx = LayerLayout.build(CodecConfig(bits=4), 3, 2014, 64)
    assert lynx.region("k_data").size == -(-n // 64) * 32
    assert lynx.region("k_plane1").size == -(-n // 64) * 32
    assert lynx.region("k_scale").shape == (3, 32, 64)
    assert lynx.region("v_scale").shape == (3, 2014, 1)
    int8 = LayerLayout.build(CodecConfig(Scheme.INT8), 3, 2014, 64)
    assert int8.num_planes == 1
    assert int8.region("k_data").size == n
    # anchor + residual carry the same payload as INT8, and the anchor stream is about half
    assert lynx.plane_size(0) + lynx.plane_size(1) == int8.plane_size(0)
    three = LayerLayout.build(CodecConfig(bits=3), 3, 2014, 64)
    assert three.region("k_data").size == n * 3 // 8
    split = LayerLayout.build(CodecConfig(planes=(2, 2, 4)), 3, 2014, 64)
    assert [split.region(f"k_{name}").size for name in ("data", "plane1", "plane2")] == [
        -(-n // 64) * 16, -(-n // 64) * 16, -(-n // 64) * 32]
    assert sum(r.size for r in split.regions) == sum(r.size for r in int8.regions)  # the same payload
    assert [r.plane for r in split.regions] == [0, 0, 0, 0, 0, 0, 1, 1, 2, 2]


def _mutate(path: list, value, data: bytes) -> bytes:
    obj = json.loads(data)
    node = obj
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(obj).encode()


_DELETE = object()

BAD = [
    (["version"], 1, "version"),
    (["version"], True, "version"),
    (["format"], "other", "format"),
    (["layers"], [], "layers"),
    (["layers", 0, "scheme"], "int3", "scheme"),
    (["layers", 0, "split"], "lsb", "split"),
    (["layers", 0, "planes"], [7, 1], "anchor"),
    (["layers", 0, "planes"], [1, 7], "anchor"),
    (["layers", 0, "planes"], [4.0, 4], "plane width"),
    (["layers", 0, "planes"], [4, 3], "sum to 7"),
    (["layers", 0, "planes"], [4, 0, 4], "at least 1 bit"),
    (["layers", 0, "planes"], [2, 1, 1, 1, 1, 1, 1, 1], "planes"),
    (["layers", 0, "planes"], [2, 2, 4], "inconsistent|regions"),
    (["layers", 0, "planes"], "4,4", "planes"),
    (["layers", 0, "tokens"], 2015, "inconsistent"),
    (["layers", 0, "tokens"], 10**12, "tokens"),
    (["layers", 0, "kv_heads"], 0, "kv_heads"),
    (["layers", 0, "k_group"], 65, "inconsistent"),
    (["layers", 0, "regions", 0, "offset"], -64, "offset"),
    (["layers", 0, "regions", 0, "offset"], 64, "inconsistent"),
    (["layers", 0, "regions", 1, "size"], 10, "inconsistent"),
    (["layers", 0, "regions", 2, "dtype"], "float64", "dtype"),
    (["layers", 0, "regions", 2, "dtype"], "uint8", "inconsistent"),
    (["layers", 0, "regions", 2, "shape"], [3, 33, 64], "inconsistent"),
    (["layers", 0, "regions", 0, "plane"], 1, "inconsistent"),
    (["layers", 0, "regions", 0, "plane"], "anchor", "plane"),
    (["layers", 0, "regions", 0, "plane"], 8, "plane"),
    (["layers", 0, "regions", 0, "bits"], 5, "inconsistent"),
    (["layers", 0, "regions", 0, "name"], "x" * 100, "name"),
    (["layers", 0, "regions"], [], "regions"),
    (["layers", 0, "offsets", 0], 32, "multiple"),
    (["layers", 1, "offsets", 0], 0, "overlap"),
    (["layers", 0, "offsets", 0], -64, "offset"),
    (["layers", 0, "offsets", 0], 1 << 50, "offset"),
    (["layers", 1, "offsets"], [0, 0, 0], "offsets"),
    (["layers", 1, "offsets"], {"anchor": 0}, "offsets"),
    (["layers", 0, "tokens"], _DELETE, "missing"),
    (["layers", 0, "extra"], 1, "unknown"),
]


@pytest.mark.parametrize(("path", "value", "needle"), BAD,
                         ids=[f"{'.'.join(map(str, p))}={v!r:.20}" for p, v, _ in BAD])
def test_corrupted_fields_are_rejected(path: list, value, needle: str) -> None:
    data = _mutate(path, value, _cache().to_bytes())
    with pytest.raises(LayoutError, match=needle):
        CacheLayout.from_bytes(data)


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[]", b"null", b'{"format":"lynx-kv-layout"}',
                                  b"[" * 100000])
def test_garbage_is_rejected(data: bytes) -> None:
    with pytest.raises(LayoutError):
        CacheLayout.from_bytes(data)


def test_size_limit() -> None:
    data = _cache().to_bytes()
    with pytest.raises(LayoutError, match="allowed"):
        CacheLayout.from_bytes(data, max_bytes=len(data) - 1)
    with pytest.raises(LayoutError, match="allowed"):
        CacheLayout.from_bytes(b" " * (5 << 20))


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_random_byte_corruption_never_escapes(data) -> None:
    """Any corruption either raises LayoutError or is itself a fully consistent layout."""
    raw = bytearray(_cache().to_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        parsed = CacheLayout.from_bytes(bytes(raw))
    except LayoutError:
        return
    parsed.validate()
    assert CacheLayout.from_bytes(parsed.to_bytes()) == parsed


def test_layout_error_is_a_codec_error() -> None:
    assert issubclass(LayoutError, CodecError)
