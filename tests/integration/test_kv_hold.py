"""``send_cache(hold_residual=True)`` over a real loopback connection: the anchors
arrive and the draft cache is built while the residual waits for the receiver's
``release_lane`` (and is encoded only then); after it, the full cache is exact."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.kvassembler import KVAssembler
from lynx_decode.kvsend import send_cache, warm_up_codec
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_transport import Lane, ReceivePool, Receiver, connect

pytestmark = pytest.mark.ucx

INFO = ModelInfo("m", num_layers=4, kv_heads=2, head_dim=16, max_positions=4096,
                 vocab_size=100, eos_token_ids=frozenset({0}))


def _prefill(tokens: int = 1000) -> Prefill:
    rng = np.random.default_rng(7)
    shape = (INFO.kv_heads, tokens - 1, INFO.head_dim)
    keys = [rng.standard_normal(shape, dtype=np.float32) for _ in range(INFO.num_layers)]
    values = [rng.standard_normal(shape, dtype=np.float32) for _ in range(INFO.num_layers)]
    return Prefill(tuple(range(1, tokens + 1)), KVBuffers.from_layers(keys, values), 0.0)


@pytest.mark.parametrize("hold", [True, False])
def test_a_held_residual_waits_for_the_decode_side(hold) -> None:
    warm_up_codec()  # as the nodes do: a first JIT compile holds the GIL past the peer timeout
    prefill = _prefill()
    streams: list = []
    assemblers: dict[int, KVAssembler] = {}
    opened = threading.Event()

    def on_open(stream) -> None:
        assemblers[stream.stream_id] = KVAssembler(stream, INFO)
        streams.append(stream)
        opened.set()

    rx = Receiver(ReceivePool(64 << 20), on_stream_open=on_open,
                  on_region=lambda s, r: assemblers[s.stream_id].on_region(r))
    try:
        with connect(rx.address, timeout=10) as conn:
            sending = send_cache(conn, prefill, "m", CodecConfig(scheme=Scheme.LYNX),
                                 request_id="r", t0_unix=0.0, hold_residual=hold)
            sent = sending.stream
            assert opened.wait(10)
            stream, asm = streams[0], assemblers[streams[0].stream_id]
            asm.open_full_gate()
            draft = asm.draft.result(10)  # the anchors land either way
            if hold:
                threading.Event().wait(0.3)
                assert not any(stream.region_done(r.name) for r in stream.regions
                               if r.lane == Lane.RESIDUAL)
                assert not asm.full.done() and rx.stats().lane(Lane.RESIDUAL).bytes == 0
                stream.release_lane(Lane.RESIDUAL)
            sending.wait(10)  # held: encodes and supplies the residual now
            full = asm.full.result(10)
            assert Lane.RESIDUAL in sent.lane_released_at if hold else not sent.lane_released_at
        for i in range(INFO.num_layers):  # exact: the INT8 codec's reconstruction, bit for bit
            enc = encode_layer(prefill.kv.keys[i], prefill.kv.values[i], CodecConfig(scheme=Scheme.INT8))
            k8, v8 = decode_layer(enc.layout, enc.buffers[0])
            assert np.array_equal(full.keys[i], k8) and np.array_equal(full.values[i], v8)
        assert not np.array_equal(draft.keys[0], full.keys[0])  # the draft is the coarse one
        stream.release()
    finally:
        rx.close()
