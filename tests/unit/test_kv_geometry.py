"""Per-layer cache geometry without a model: shapes whose layers differ (heads, head
size, sliding windows), and a KV stream of a model that interleaves sliding and
full layers over the in-memory transport: each sliding layer's regions carry its
window's last ``window - 1`` tokens only, and the decode side rebuilds exactly
those positions, bit for bit what the INT8 codec gives for them."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.kvassembler import KVAssembler
from lynx_decode.kvheader import KVHeader, cache_bytes
from lynx_decode.kvsend import send_cache, warm_up_codec
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_transport import ReceivePool, ReceiveStream
from lynx_transport.seam import ReceiverCallbacks
from lynx_transport.testing import MemoryTransport

WINDOW = 16
LAYERS = (LayerGeometry(2, 16, WINDOW), LayerGeometry(2, 16), LayerGeometry(2, 16, WINDOW), LayerGeometry(2, 16))
INFO = ModelInfo("interleaved", 4, 2, 16, 4096, 100, frozenset({0}), layers=LAYERS)


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    warm_up_codec()


def _prefill(tokens: int, seed: int = 3) -> Prefill:
    rng = np.random.default_rng(seed)
    kv = KVBuffers(INFO.kv_shape(tokens - 1, windowed=False))
    for i in range(INFO.num_layers):
        kv.write_layer(i, *(rng.standard_normal((2, tokens - 1, 16), dtype=np.float32) for _ in range(2)))
    return Prefill(tuple(range(1, tokens + 1)), kv, 0.0)


def test_a_window_keeps_the_last_positions_it_can_attend_to() -> None:
    g = LayerGeometry(4, 64, window=4096)
    assert (g.kept(10), g.kept(4095), g.kept(20000)) == (10, 4095, 4095)
    assert LayerGeometry(4, 64).kept(20000) == 20000
    for bad in ({"window": 1}, {"window": True}, {"dtype": "bfloat16"}):
        with pytest.raises(DecodeError):
            LayerGeometry(4, 64, **bad)  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        LayerGeometry.from_json({"kv_heads": 4, "head_dim": 64, "window": None})


def test_shapes_and_buffers_of_layers_that_differ() -> None:
    mixed = (LayerGeometry(2, 16, WINDOW), LayerGeometry(4, 48))
    shape = KVShape.of(mixed, 100)
    assert [shape.shape_of(i) for i in range(2)] == [(2, WINDOW - 1, 16), (4, 100, 48)]
    assert not shape.uniform and shape.stored_values == 2 * (2 * 15 * 16 + 4 * 100 * 48)
    assert shape.values_per_token == 2 * (2 * 16 + 4 * 48)
    kv = KVBuffers(shape, headroom=5)
    k, _ = kv.layer(1)
    assert k.shape == (4, 100, 48) and kv.storage_keys[1].shape == (4, 105, 48)
    with pytest.raises(DecodeError, match="differ in shape"):
        _ = kv.keys
    with pytest.raises(DecodeError, match="the model expects"):
        kv.write_layer(0, np.zeros((2, 100, 16)), np.zeros((2, 100, 16)))
    # a model whose layers are all full and alike has the plain shape it always had
    assert ModelInfo("m", 3, 2, 8, 64, 10, frozenset()).kv_shape(9) == KVShape(3, 2, 9, 8)
    # a prefill holds every position of every layer, windows or not
    assert INFO.kv_shape(99, windowed=False) == KVShape(4, 2, 99, 16)


def test_a_stream_of_interleaved_layers_sends_each_window_only() -> None:
    tokens = 4 * WINDOW + 1  # the cache covers four windows
    prefill = _prefill(tokens)
    transport = MemoryTransport()
    opened: cf.Future[KVAssembler] = cf.Future()
    assemblers: dict[int, KVAssembler] = {}

    def on_open(stream: ReceiveStream) -> None:
        assemblers[stream.stream_id] = KVAssembler(stream, INFO, headroom=4)
        opened.set_result(assemblers[stream.stream_id])

    callbacks = ReceiverCallbacks(on_stream_open=on_open,
                                  on_region=lambda s, r: assemblers[s.stream_id].on_region(r))
    config = CodecConfig(Scheme.LYNX, planes=(4, 4))
    with transport.listen(ReceivePool(4 << 20), callbacks=callbacks) as listener, \
            transport.connect(listener.address, timeout=5) as conn:
        sending = send_cache(conn, prefill, INFO, config, request_id="r", t0_unix=0.0)
        assembler = opened.result(5)
        assembler.open_full_gate()  # as the decode node does once its first token is out
        full = assembler.full.result(5)
        sending.wait(5)
        assembler.stream.release()
    covered = tokens - 1
    header = assembler.header
    assert header.geometry == LAYERS and [layer.tokens for layer in header.layout.layers] == [15, 64, 15, 64]
    assert sending.stream.manifest.total_bytes == 4 * tokens + cache_bytes(LAYERS, covered, config)
    assert header.naive_bytes() == 4 * tokens + cache_bytes([LayerGeometry(2, 16)] * 4, covered, config)
    assert sending.stream.manifest.total_bytes < 0.65 * header.naive_bytes()
    for i, g in enumerate(LAYERS):  # what landed: the INT8 codec's reconstruction of the kept positions
        kept = g.kept(covered)
        k, v = (np.ascontiguousarray(x[:, covered - kept:]) for x in prefill.kv.layer(i))
        want = encode_layer(k, v, CodecConfig(Scheme.INT8))
        out_k, out_v = np.empty_like(k), np.empty_like(v)
        decode_layer(want.layout, want.buffers[0], out_k=out_k, out_v=out_v)
        got_k, got_v = full.layer(i)
        np.testing.assert_array_equal(got_k, out_k)
        np.testing.assert_array_equal(got_v, out_v)


def test_a_header_must_describe_what_it_carries() -> None:
    prefill = _prefill(40)
    layout = KVHeader("r", "m", Scheme.INT8, 40, 0.0,
                      _layout(LAYERS, 39), LAYERS).layout
    with pytest.raises(LayoutError, match="describes 3 layers, its layout 4"):
        KVHeader.from_metadata(KVHeader("r", "m", Scheme.INT8, 40, 0.0, layout, LAYERS[:3]).to_metadata())
    wrong = (LayerGeometry(2, 16, 8), *LAYERS[1:])  # a window of 8 keeps 7 tokens, the layout has 15
    with pytest.raises(LayoutError, match="layer 0 caches 15 tokens; a prompt of 40 tokens needs 7"):
        KVHeader.from_metadata(KVHeader("r", "m", Scheme.INT8, 40, 0.0, layout, wrong).to_metadata())
    assert prefill.kv.shape.tokens == 39


def _layout(layers: tuple[LayerGeometry, ...], covered: int):
    from lynx_decode.codec.layout import CacheLayout, LayerLayout

    return CacheLayout.of([LayerLayout.build(CodecConfig(Scheme.INT8), g.kv_heads, g.kept(covered), g.head_dim)
                           for g in layers])
