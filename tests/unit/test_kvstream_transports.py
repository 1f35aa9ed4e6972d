"""KV caches over every transport (the ``transport`` fixture: the in-memory twin and
UCX): ``send_cache`` on one side, ``KVAssembler`` on the other, as the prefill and
decode nodes use them, without a model (a synthetic ``Prefill``, sent as it is or
encoded first, as the prefill node holds it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec.config import CodecConfig, Scheme, Split
from lynx_decode.errors import CodecError, DecodeError
from lynx_decode.held_forms import held_as
from lynx_decode.kvassembler import KVAssembler
from lynx_decode.kvencode import EncodedCache, encode_cache
from lynx_decode.kvsend import send_cache, warm_up_codec
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_transport import Lane, ReceivePool, ReceiveStream, StreamState, TransportConfig
from lynx_transport.errors import StreamCancelledError, TransportError, TransportTimeoutError
from lynx_transport.seam import ReceiverCallbacks, Sender, Transport
from lynx_transport.testing import wait_until

INFO = ModelInfo("m", num_layers=4, kv_heads=2, head_dim=16, max_positions=4096,
                 vocab_size=100, eos_token_ids=frozenset({0}))
CFG = TransportConfig(chunk_bytes=16 << 10, max_inflight_bytes=64 << 10, pool_wait_s=0)
WAIT = 10.0
#: A generous bound on hearing of a failed send: the cancel itself tells the receiver (the
#: tests check that the error is the cancel, not a timeout); it takes milliseconds.
PROMPTLY_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def _warm_codec() -> None:
    # as the nodes do: a cold Numba compile inside a live connection holds the GIL
    # past the peer timeout
    warm_up_codec()


def _prefill(tokens: int = 300, seed: int = 7) -> Prefill:
    rng = np.random.default_rng(seed)
    shape = (INFO.kv_heads, tokens - 1, INFO.head_dim)
    keys = [rng.standard_normal(shape, dtype=np.float32) for _ in range(INFO.num_layers)]
    values = [rng.standard_normal(shape, dtype=np.float32) for _ in range(INFO.num_layers)]
    return Prefill(tuple(range(1, tokens + 1)), KVBuffers.from_layers(keys, values), 0.0)


class Decoder:
    """The decode node's side: a ``KVAssembler`` per stream, fed by the callbacks."""

    def __init__(self) -> None:
        self.assembler: cf.Future[KVAssembler] = cf.Future()
        self.stream: ReceiveStream | None = None
        self.failed = threading.Event()
        self.failed_at: float | None = None
        self.errors: list[TransportError] = []

    def callbacks(self) -> ReceiverCallbacks:
        return ReceiverCallbacks(on_stream_open=self.on_open, on_region=self.on_region,
                                 on_stream_failed=self.on_failed)

    def on_open(self, stream: ReceiveStream) -> None:
        self.stream = stream
        try:
            self.assembler.set_result(KVAssembler(stream, INFO))
        except Exception as exc:
            self.assembler.set_exception(exc)

    def on_region(self, stream: ReceiveStream, region: Any) -> None:
        self.assembler.result(0).on_region(region)

    def on_failed(self, stream: ReceiveStream, error: TransportError) -> None:
        self.failed_at = time.monotonic()
        self.errors.append(error)
        self.assembler.result(0).on_failed(error)
        self.failed.set()


class Recording:
    """A sender that remembers the streams it opened (``send_cache`` may raise before
    it returns its own)."""

    def __init__(self, conn: Sender) -> None:
        self.conn = conn
        self.opened: list[Any] = []

    def open_stream(self, *args: Any, **kwargs: Any) -> Any:
        stream = self.conn.open_stream(*args, **kwargs)
        self.opened.append(stream)
        return stream


@contextlib.contextmanager
def decode_side(transport: Transport, pool_bytes: int = 16 << 20) -> Iterator[tuple[Decoder, Sender, ReceivePool]]:
    decoder = Decoder()
    pool = ReceivePool(pool_bytes)
    with transport.listen(pool, config=CFG, callbacks=decoder.callbacks()) as rx, \
            transport.connect(rx.address, timeout=WAIT, config=CFG) as conn:
        yield decoder, conn, pool


def _source(prefill: Prefill, config: CodecConfig, form: str) -> Prefill | EncodedCache:
    """What ``send_cache`` is given: the float32 prefill, its encoding held beforehand, or the form
    the prefill node holds it in (``held``: a LYNX split as INT8 codes, its planes cut as sent)."""
    if form == "prefill":
        return prefill
    return encode_cache(prefill, prefill.kv.shape.geometry, held_as(config) if form == "held" else config)


FORMS = ["prefill", "encoded", "held"]


def _reference(prefill: Prefill, config: CodecConfig, i: int, *, residual: bool = True) -> tuple:
    enc = encode_layer(prefill.kv.keys[i], prefill.kv.values[i], config)
    res = enc.buffers.get(1) if residual else None
    return decode_layer(enc.layout, enc.buffers[0], res)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scheme", [Scheme.BF16, Scheme.INT8, Scheme.INT4, Scheme.LYNX])
def test_the_assembled_caches_equal_the_codecs_reconstruction(transport, scheme, form) -> None:
    prefill, config = _prefill(), CodecConfig(scheme=scheme)
    with decode_side(transport) as (decoder, conn, pool):
        sending = send_cache(conn, _source(prefill, config, form), "m", config, request_id="r", t0_unix=0.0)
        asm = decoder.assembler.result(WAIT)
        asm.open_full_gate()
        sending.wait(WAIT)
        assert sending.stream.state is StreamState.COMPLETED
        full = asm.full.result(WAIT)
        assert asm.prompt_ids(WAIT) == prefill.token_ids
        for i in range(INFO.num_layers):  # bit for bit
            k, v = _reference(prefill, config, i)
            assert np.array_equal(full.keys[i], k) and np.array_equal(full.values[i], v)
        if scheme is Scheme.LYNX:
            assert asm.draft is not None
            draft = asm.draft.result(WAIT)
            for i in range(INFO.num_layers):
                k, v = _reference(prefill, config, i, residual=False)
                assert np.array_equal(draft.keys[i], k) and np.array_equal(draft.values[i], v)
            assert not np.array_equal(draft.keys[0], full.keys[0])
        else:
            assert asm.draft is None
        assert decoder.stream is not None
        decoder.stream.release()
        assert pool.free_bytes == pool.nbytes and not decoder.errors


def test_a_layer_the_gate_held_back_is_taken_on_the_engines_thread(transport) -> None:
    # the gate closed (no first token yet): the exact level's layers land but wait; the engine
    # takes the one it is about to read (dequantized on its thread, bit for bit INT8's), not
    # the others; the gate, once opened, does the rest
    prefill, config = _prefill(), CodecConfig(scheme=Scheme.LYNX)
    with decode_side(transport) as (decoder, conn, _):
        sending = send_cache(conn, prefill, "m", config, request_id="r", t0_unix=0.0)
        asm = decoder.assembler.result(WAIT)
        sending.wait(WAIT)
        assert decoder.stream is not None and asm.draft is not None
        assert wait_until(lambda: asm.eta(1) == 0.0, WAIT)  # every region's callback came
        exact = asm.levels[-1]
        assert exact.buffers is not None and exact.take is not None
        assert not exact.buffers.written(2) and not asm.full.done()
        assert exact.take(2) and exact.buffers.written(2)
        k, v = _reference(prefill, CodecConfig(scheme=Scheme.INT8), 2)
        assert np.array_equal(exact.buffers.layer(2)[0], k) and np.array_equal(exact.buffers.layer(2)[1], v)
        assert [exact.buffers.written(i) for i in range(INFO.num_layers)] == [False, False, True, False]
        asm.open_full_gate()
        assert asm.full.result(WAIT) is exact.buffers and exact.take(0)
        decoder.stream.release()


@pytest.mark.parametrize("form", FORMS)
def test_a_held_residual_waits_for_the_decode_side(transport, form) -> None:
    prefill, config = _prefill(), CodecConfig(scheme=Scheme.LYNX)
    with decode_side(transport) as (decoder, conn, _):
        sending = send_cache(conn, _source(prefill, config, form), "m", config, request_id="r",
                             t0_unix=0.0, hold_residual=True)
        asm = decoder.assembler.result(WAIT)
        asm.open_full_gate()
        assert asm.draft is not None
        asm.draft.result(WAIT)  # the anchors land while the residual is held
        stream = decoder.stream
        assert stream is not None
        with pytest.raises(TransportTimeoutError):
            stream.wait_lane(Lane.RESIDUAL, 0.05)
        assert not asm.full.done() and not sending.stream.lane_released_at
        stream.release_lane(Lane.RESIDUAL)
        sending.wait(WAIT)  # supplies the residual now (a prefill's encoded only now)
        full = asm.full.result(WAIT)
        assert Lane.RESIDUAL in sending.stream.lane_released_at
        int8 = CodecConfig(scheme=Scheme.INT8)  # LYNX anchor + residual is INT8, exactly
        for i in range(INFO.num_layers):
            k, v = _reference(prefill, int8, i)
            assert np.array_equal(full.keys[i], k) and np.array_equal(full.values[i], v)
        stream.release()


@pytest.mark.parametrize("how", ["layer 2 cannot be encoded", "the held residual is never released"])
def test_a_failed_send_cancels_the_stream_and_the_receiver_hears_at_once(transport, how) -> None:
    prefill, config = _prefill(), CodecConfig(scheme=Scheme.LYNX)
    with decode_side(transport) as (decoder, conn, pool):
        recording = Recording(conn)
        if how == "layer 2 cannot be encoded":
            prefill.kv.keys[2][0, 0, 0] = np.nan
            with pytest.raises(CodecError, match="finite"):
                send_cache(recording, prefill, "m", config, request_id="r", t0_unix=0.0)  # type: ignore[arg-type]
        else:
            sending = send_cache(recording, prefill, "m", config, request_id="r", t0_unix=0.0,  # type: ignore[arg-type]
                                 hold_residual=True)
            draft = decoder.assembler.result(WAIT).draft
            assert draft is not None
            draft.result(WAIT)  # the anchors are in
            with pytest.raises(TransportTimeoutError, match="release of lane 1"):
                sending.wait(0.1)
        failed_at = time.monotonic()
        (sent,) = recording.opened
        with pytest.raises(StreamCancelledError):
            sent.wait(PROMPTLY_S)
        assert sent.state is StreamState.CANCELLED
        # the receiver is told by the cancel itself, not by a timeout
        assert decoder.failed.wait(PROMPTLY_S)
        assert decoder.failed_at is not None and decoder.failed_at - failed_at < PROMPTLY_S
        assert len(decoder.errors) == 1 and isinstance(decoder.errors[0], StreamCancelledError)
        asm = decoder.assembler.result(0)
        # the futures fail with the stream's own error (a region callback still queued
        # when the stream failed reports that error, not its views' release)
        assert isinstance(asm.full.exception(0), StreamCancelledError)
        assert decoder.stream is not None and decoder.stream.state is StreamState.CANCELLED
        assert wait_until(lambda: pool.free_bytes == pool.nbytes, WAIT)


def test_an_encoded_cache_is_sent_only_as_what_it_was_encoded_for(transport) -> None:
    prefill = _prefill()
    held = encode_cache(prefill, prefill.kv.shape.geometry, CodecConfig(scheme=Scheme.INT8))
    assert held.nbytes == sum(layer.wire_bytes() for layer in held.layers) > 0
    with decode_side(transport) as (_, conn, _):
        recording = Recording(conn)
        # INT8 codes serve a LYNX split on their grid (cut as sent), nothing else
        for config in (CodecConfig(scheme=Scheme.INT4), CodecConfig(scheme=Scheme.BF16),
                       CodecConfig(scheme=Scheme.LYNX, split=Split.ROUNDED),
                       CodecConfig(scheme=Scheme.LYNX, k_group=32)):
            with pytest.raises(DecodeError, match="encoded as"):
                send_cache(recording, held, "m", config, request_id="r", t0_unix=0.0)
        assert not recording.opened  # refused before anything went out
        other = ModelInfo("m", num_layers=4, kv_heads=2, head_dim=8, max_positions=4096,
                          vocab_size=100, eos_token_ids=frozenset({0}))
        with pytest.raises(DecodeError, match="geometry"):
            send_cache(recording, held, other, held.config, request_id="r", t0_unix=0.0)
        assert not recording.opened
