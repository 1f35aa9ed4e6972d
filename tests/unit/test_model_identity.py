"""Model identity on the wire and every refusal of the decode node.

A KV header carries the prefill model's fingerprint; a stream from another model
(another fingerprint, another id, another geometry) is refused with a message
naming both. Each refusal path of ``DecodeNode`` (an unreadable header, another
model, another geometry, regions that do not match their header) fails the
waiting run at once with the reason (well under 2 s, not a stream timeout), ends
the stream (the sender's stream fails: it is told) and the node serves on.
Over the in-memory transport, with a rogue prefill node that sends what a test
crafts."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.decode_node import DecodeNode
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.kvheader import KVHeader
from lynx_decode.kvsend import send_cache, warm_up_codec
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.identity import ModelFingerprint, cached_fingerprint
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_decode.request import KVRequest
from lynx_decode.timeouts import Timeouts
from lynx_transport import Lane, ReceivePool, ReceiveStream
from lynx_transport.errors import LynxError, StreamFailedError
from lynx_transport.seam import ReceiverCallbacks
from lynx_transport.testing import MemoryTransport, wait_until
from tests._speculative_helpers import ToyLM

FP = ModelFingerprint("toy", "a" * 32, "b" * 32, "c" * 32)
PROMPT = list(range(1, 60))
#: The decode node's stream timeout; a refusal names its reason long before it (a generous bound:
#: the reason, not the time, is what the refusal tests check).
STREAM_S = 60.0


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    warm_up_codec()


def test_a_fingerprint_names_what_differs() -> None:
    other = dataclasses.replace(FP, name="other", weights="d" * 32, tokenizer="e" * 32)
    assert other.differences(FP) == ["weights", "tokenizer"] and FP.differences(FP) == []
    assert ModelFingerprint.from_json(FP.to_json()) == FP
    for bad in ({**FP.to_json(), "weights": "xyz"}, {"name": "n"}, [1, 2]):
        with pytest.raises(LayoutError):
            ModelFingerprint.from_json(bad)


def test_a_fingerprint_is_computed_once_and_cached(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from tests._tiny_models import tokenizer

    model = torch.nn.Linear(4, 4)
    model.config = _Config()  # what fingerprint_model reads of a transformers model
    first = cached_fingerprint("key", tmp_path, "tiny", model, tokenizer(), [LayerGeometry(1, 4)])
    assert len(list(tmp_path.glob("*.json"))) == 1
    with torch.no_grad():
        model.weight.add_(1.0)  # the same key (a directory unchanged): read back, not recomputed
    assert cached_fingerprint("key", tmp_path, "tiny", model, tokenizer(), [LayerGeometry(1, 4)]) == first
    fresh = cached_fingerprint("other-key", tmp_path, "tiny", model, tokenizer(), [LayerGeometry(1, 4)])
    assert fresh.differences(first) == ["weights"]
    permuted = cached_fingerprint("third", tmp_path, "tiny", model, tokenizer(permuted=True), [LayerGeometry(1, 4)])
    assert permuted.differences(fresh) == ["tokenizer"]
    windowed = cached_fingerprint("fourth", tmp_path, "tiny", model, tokenizer(), [LayerGeometry(1, 4, 8)])
    assert windowed.differences(fresh) == ["config"]


class _Config:
    def get_text_config(self, decoder: bool = True) -> _Config:
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": "toy", "hidden_size": 4, "_name_or_path": "/anywhere"}


# -- the header's checks ------------------------------------------------------------------------
def _info(model_id: str = "toy", fingerprint: ModelFingerprint | None = FP,
          layers: tuple[LayerGeometry, ...] = ()) -> ModelInfo:
    return ModelInfo(model_id, len(layers) or 1, 1, 1, 4096, 40, frozenset(), layers=layers,
                     fingerprint=fingerprint)


def _prefill(layers: int = 1, heads: int = 1, dim: int = 1) -> Prefill:
    rng = np.random.default_rng(0)
    shape = (heads, len(PROMPT) - 1, dim)
    kv = KVBuffers.from_layers([rng.standard_normal(shape, dtype=np.float32) for _ in range(layers)],
                               [rng.standard_normal(shape, dtype=np.float32) for _ in range(layers)])
    return Prefill(tuple(PROMPT), kv, 0.0)


def _header(sender: ModelInfo) -> KVHeader:
    """The header ``send_cache`` would put on the wire for ``sender``'s prefill."""
    captured: list[bytes] = []

    class Capture:
        def open_stream(self, regions: Any, metadata: bytes, **_: Any) -> Any:
            captured.append(metadata)
            raise _Stop

    with pytest.raises(_Stop):
        send_cache(Capture(), _prefill(sender.num_layers, sender.kv_heads, sender.head_dim),  # type: ignore[arg-type]
                   sender, CodecConfig(Scheme.INT8), request_id="r", t0_unix=0.0)
    return KVHeader.from_metadata(captured[0])


class _Stop(Exception):
    pass


def test_the_header_carries_the_fingerprint_and_a_foreign_one_is_refused() -> None:
    header = _header(_info())
    assert header.fingerprint == FP
    header.check_model(_info())  # the same model
    foreign = dataclasses.replace(FP, name="other", weights="d" * 32)
    with pytest.raises(DecodeError, match=r"computed by the model toy \(weights aaaaaaaaaaaa.*runs other "
                                          r"\(weights dddddddddddd.*they differ in their weights"):
        header.check_model(_info(fingerprint=foreign))
    # without a fingerprint on either side the model ids must agree
    with pytest.raises(DecodeError, match="computed by the model 'toy', but this decode node runs 'other'"):
        _header(_info(fingerprint=None)).check_model(_info("other", fingerprint=None))


def test_a_stream_of_another_geometry_is_refused_and_a_whole_layer_accepted() -> None:
    windowed = _info(layers=(LayerGeometry(1, 1, 8), LayerGeometry(1, 1)))
    header = _header(windowed)
    assert [layer.tokens for layer in header.layout.layers] == [7, len(PROMPT) - 1]
    with pytest.raises(DecodeError, match="layer 0 is 1 kv heads x 1, window 8 in the stream, "
                                          "1 kv heads x 1, window 4 in the model"):
        header.check_model(_info(layers=(LayerGeometry(1, 1, 4), LayerGeometry(1, 1))))
    # a sender that sends every layer whole (no windows) suits a windowed model: it masks them itself
    whole = _header(_info(layers=(LayerGeometry(1, 1), LayerGeometry(1, 1))))
    shape = whole.check_model(windowed)
    assert [shape.shape_of(i)[1] for i in range(2)] == [len(PROMPT) - 1] * 2


# -- the decode node's refusals -----------------------------------------------------------------
class RoguePrefill:
    """Receives requests like a prefill node and answers each with ``craft(conn, request)``."""

    def __init__(self, transport: MemoryTransport, craft: Callable[[Any, KVRequest], Any]) -> None:
        self.transport, self.craft = transport, craft
        self.sent: list[Any] = []
        self.errors: list[BaseException] = []
        self.conns: list[Any] = []
        self._listener = transport.listen(ReceivePool(1 << 20), callbacks=ReceiverCallbacks(
            on_stream_complete=self._on_request))
        self.address = self._listener.address

    def _on_request(self, stream: ReceiveStream) -> None:
        request = KVRequest.from_metadata(stream.metadata)
        stream.release()
        threading.Thread(target=self._answer, args=(request,), daemon=True).start()

    def _answer(self, request: KVRequest) -> None:
        try:
            conn = self.transport.connect(request.reply_to, timeout=5)
            self.conns.append(conn)
            self.sent.append(self.craft(conn, request))
        except BaseException as exc:
            self.errors.append(exc)

    def close(self) -> None:
        """The listener and every connection it answered on (each an egress with the
        transport's thread behind it: none outlives the test)."""
        for conn in self.conns:
            conn.close()
        self._listener.close()


def _send(model: ModelInfo, mutate: Callable[[dict[str, Any]], None] | None = None,
          regions: Callable[[list[tuple[str, int, int]]], list[tuple[str, int, int]]] | None = None, *,
          held: bool = False):
    """``held``: a LYNX cache whose residual waits for the receiver's release, so the stream cannot
    complete before the receiver decides (a tiny stream would otherwise land whole first, and a
    refusal then has no live stream to end)."""
    def craft(conn: Any, request: KVRequest) -> Any:
        if mutate is None and regions is None:
            return send_cache(conn, _prefill(model.num_layers, model.kv_heads, model.head_dim), model,
                              CodecConfig(Scheme.LYNX if held else Scheme.INT8), request_id=request.request_id,
                              t0_unix=time.time(), hold_residual=held)
        header = _header(model)
        header = dataclasses.replace(header, request_id=request.request_id)
        obj = json.loads(zlib.decompress(header.to_metadata()))
        if mutate is not None:
            mutate(obj)
        listed = header.regions() if regions is None else regions(header.regions())
        return conn.open_stream(listed, metadata=zlib.compress(json.dumps(obj).encode()), timeout=5)
    return craft


class TextToyLM(ToyLM):
    def detokenize(self, token_ids: Any) -> str:
        return " ".join(map(str, token_ids))


@pytest.fixture
def decode_toy() -> Iterator[tuple[DecodeNode, MemoryTransport]]:
    transport = MemoryTransport()
    model = TextToyLM(eos=False)
    model.info = dataclasses.replace(model.info, fingerprint=FP)
    with DecodeNode(model, transport=transport, timeouts=Timeouts(stream_s=STREAM_S), pool_bytes=1 << 20) as node:
        yield node, transport


REFUSALS = {
    "an unsupported header": (None, lambda o: o.update(version=99), None, "KV header version 99 is not supported"),
    "a header that does not parse": (None, lambda o: o.update(geometry="flat"), None,
                                     "the geometry must be a list"),
    "another model": (dataclasses.replace(FP, name="other", config="f" * 32), None, None,
                      "they differ in their config"),
    "another geometry": ("geometry", None, None, "window 8 in the stream"),
    "regions that do not match the header": (None, None, lambda r: [*r, ("extra", 8, int(Lane.ANCHOR))],
                                             "regions do not match its KV header"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_every_refusal_reaches_the_run_at_once_and_ends_the_stream(case: str, decode_toy: Any) -> None:
    node, transport = decode_toy
    sender_fp, mutate, regions, message = REFUSALS[case]
    if sender_fp == "geometry":
        sender = _info(layers=(LayerGeometry(1, 1, 8),))
    else:
        sender = _info(fingerprint=FP if sender_fp is None else sender_fp)
    rogue = RoguePrefill(transport, _send(sender, mutate, regions, held=True))
    try:
        start = time.monotonic()
        with pytest.raises(LynxError, match=message):
            node.run(rogue.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=2)
        assert time.monotonic() - start < STREAM_S / 3  # refused, not timed out
        assert wait_until(lambda: rogue.sent or rogue.errors, 5)
        if rogue.sent:  # the sender is told: its stream fails (abandoned by the receiver)
            with pytest.raises(StreamFailedError, match="rejected the stream"):
                rogue.sent[0].wait(5)
        # and the node serves on: the same rogue, now answering with a cache of the right model
        rogue.craft = _send(_info())
        assert len(node.run(rogue.address, PROMPT, scheme=Scheme.INT8, max_new_tokens=2).tokens) == 2
    finally:
        rogue.close()
