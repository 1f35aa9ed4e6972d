"""KV caches as transport streams: what the prefill node sends and how the decode
node assembles it, layer by layer, as regions land.

Wire convention (on top of :mod:`lynx_transport`, which moves named byte regions):

- the stream's metadata is a :class:`KVHeader` (zlib-compressed JSON, bounded):
  model id, scheme, the prompt length, the clock start ``t0_unix`` and the
  :class:`~lynx_decode.codec_layout.CacheLayout` of every layer;
- region ``tokens`` (int32 prompt ids, all of them: the cache covers
  ``ids[:-1]`` and the decode node runs the last one itself) travels first on
  ``Lane.ANCHOR``;
- region ``L{i}.anchor`` (layer ``i``'s anchor buffer: packed anchors + scales, or
  the whole INT8/INT4/BF16 layer) on ``Lane.ANCHOR`` and ``L{i}.residual`` on
  ``Lane.RESIDUAL``.

The sender announces the whole stream first (sizes are known from the layout),
then encodes layer after layer and supplies each anchor as soon as it is
encoded, so encoding overlaps the transfer; residuals are supplied after the
last anchor, so the anchor lane finishes first even when the encoder, not the
link, is the bottleneck.

The receiver side (:class:`KVAssembler`) runs on the transport's callback thread:
each landed anchor is dequantized into the *draft* cache, each layer whose anchor
and residual have both landed into the *full* (exact INT8) cache. Two futures
resolve when a cache is complete; a failed stream fails the futures that are
still pending, so the decode engine never waits past a transport error.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec_config import DEFAULT_ANCHOR_BITS, CodecConfig, Scheme, Stream
from lynx_decode.codec_layout import CacheLayout, LayerLayout
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_transport import Lane, ReceivedRegion, ReceiveStream, SendStream
from lynx_transport.errors import LynxError, TransportError
from lynx_transport.seam import Sender

__all__ = ["KVHeader", "KV_FORMAT", "send_cache", "CacheSend", "KVAssembler", "region_name", "lane_of",
           "warm_up_codec"]

KV_FORMAT = "lynx-kv-stream"
KV_VERSION = 1
#: Decompressed metadata larger than this is rejected (no zip bombs).
MAX_HEADER_BYTES = 4 << 20
TOKENS = "tokens"

_LANES = {Stream.ANCHOR: Lane.ANCHOR, Stream.RESIDUAL: Lane.RESIDUAL}


def region_name(layer: int, stream: Stream) -> str:
    return f"L{layer}.{stream.value}"


def lane_of(stream: Stream) -> Lane:
    return _LANES[stream]


def _parse_name(name: str, layers: int) -> tuple[int, Stream]:
    head, _, tail = name.partition(".")
    try:
        layer, stream = int(head[1:]), Stream(tail)
    except ValueError:
        raise DecodeError(f"unexpected region {name!r} in a KV stream") from None
    if not head.startswith("L") or not 0 <= layer < layers:
        raise DecodeError(f"unexpected region {name!r} in a KV stream")
    return layer, stream


@dataclasses.dataclass(frozen=True)
class KVHeader:
    """What the decode node learns about a KV stream before its data arrives."""

    request_id: str
    model_id: str
    scheme: Scheme
    prompt_tokens: int
    t0_unix: float
    layout: CacheLayout

    def to_metadata(self) -> bytes:
        obj = {"format": KV_FORMAT, "version": KV_VERSION, "request_id": self.request_id,
               "model_id": self.model_id,
               "scheme": self.scheme.value, "prompt_tokens": self.prompt_tokens,
               "t0_unix": self.t0_unix, "layout": self.layout.to_bytes().decode()}
        return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 6)

    @classmethod
    def from_metadata(cls, data: bytes) -> KVHeader:
        """Parse and validate; :class:`LayoutError` on anything malformed."""
        try:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(bytes(data), MAX_HEADER_BYTES)
            if inflater.unconsumed_tail:
                raise LayoutError(f"KV header inflates past {MAX_HEADER_BYTES} bytes")
            obj = json.loads(raw)
        except (zlib.error, ValueError) as exc:
            raise LayoutError(f"KV header is not compressed JSON: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != KV_FORMAT:
            raise LayoutError("stream metadata is not a Lynx KV header")
        if obj.get("version") != KV_VERSION:
            raise LayoutError(f"KV header version {obj.get('version')!r} is not supported "
                              f"(this build reads {KV_VERSION})")
        try:
            scheme = Scheme(obj["scheme"])
            tokens, t0 = obj["prompt_tokens"], obj["t0_unix"]
            model_id, layout_text = obj["model_id"], obj["layout"]
            request_id = obj["request_id"]
        except (KeyError, ValueError) as exc:
            raise LayoutError(f"KV header field is missing or invalid: {exc}") from None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
            raise LayoutError(f"KV header prompt_tokens must be an int >= 2, got {tokens!r}")
        if not isinstance(t0, (int, float)) or not isinstance(model_id, str) \
                or not isinstance(layout_text, str) or not isinstance(request_id, str):
            raise LayoutError("KV header fields have the wrong types")
        layout = CacheLayout.from_bytes(layout_text.encode())
        header = cls(request_id, model_id, scheme, tokens, float(t0), layout)
        for i, layer in enumerate(layout.layers):
            if layer.scheme is not scheme:
                raise LayoutError(f"layer {i} is {layer.scheme.value}, the header says {scheme.value}")
            if layer.shape != layout.layers[0].shape:
                raise LayoutError(f"layer {i} has shape {layer.shape}, layer 0 {layout.layers[0].shape}")
            if layer.shape[1] != tokens - 1:
                raise LayoutError(f"layer {i} caches {layer.shape[1]} tokens; a prompt of {tokens} "
                                  f"tokens needs {tokens - 1}")
        return header

    def check_model(self, info: ModelInfo) -> KVShape:
        """The cache shape, or :class:`DecodeError` if the stream does not fit ``info``."""
        heads, tokens, dim = self.layout.layers[0].shape
        got = (len(self.layout.layers), heads, dim)
        want = (info.num_layers, info.kv_heads, info.head_dim)
        if got != want:
            raise DecodeError(f"the stream's layout (layers, kv_heads, head_dim) = {got} does not "
                              f"match the model {info.model_id}: {want}")
        if self.prompt_tokens > info.max_positions:
            raise DecodeError(f"the stream's prompt has {self.prompt_tokens} tokens, more than the "
                              f"model's {info.max_positions} positions")
        return info.kv_shape(tokens)

    def regions(self) -> list[tuple[str, int, int]]:
        """``(name, nbytes, lane)`` of every region, anchors (in layer order) first."""
        out = [(TOKENS, 4 * self.prompt_tokens, int(Lane.ANCHOR))]
        for stream in (Stream.ANCHOR, Stream.RESIDUAL):
            for i, layer in enumerate(self.layout.layers):
                if stream in layer.streams:
                    out.append((region_name(i, stream), layer.stream_size(stream), int(lane_of(stream))))
        return out


def warm_up_codec(bits: int = DEFAULT_ANCHOR_BITS) -> None:
    """Encode and decode a tiny layer in every scheme, so JIT compilation (or loading
    Numba's on-disk cache) happens at node start-up, not inside a timed run."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 70, 16), dtype=np.float32)
    for scheme in (Scheme.BF16, Scheme.INT8, Scheme.INT4, Scheme.LYNX):
        encoded = encode_layer(k, k, CodecConfig(scheme=scheme, bits=bits if scheme is Scheme.LYNX else 4))
        anchor = encoded.buffers[Stream.ANCHOR]
        decode_layer(encoded.layout, anchor)
        if Stream.RESIDUAL in encoded.buffers:
            decode_layer(encoded.layout, anchor, encoded.buffers[Stream.RESIDUAL])


class CacheSend:
    """A cache on its way out (from :func:`send_cache`): :attr:`stream`, and
    :meth:`wait`, which finishes the send. It keeps the encoded buffers alive
    until the stream is done."""

    def __init__(self, stream: SendStream, prefill: Prefill, config: CodecConfig,
                 keep: list[Any], deferred: bool) -> None:
        self.stream = stream
        self._prefill = prefill
        self._config = config
        self._keep = keep
        self._deferred = deferred

    def wait(self, timeout: float) -> None:
        """Finish the send within ``timeout`` seconds: for a held residual, wait for
        the receiver to release it, then encode and supply it layer by layer; then
        wait for the receiver's confirmation of the whole stream. Raises the
        stream's error, or ``TransportTimeoutError``; a failed send is cancelled."""
        deadline = time.monotonic() + timeout
        try:
            if self._deferred:
                self._deferred = False
                self.stream.wait_released(Lane.RESIDUAL, timeout)
                kv = self._prefill.kv
                for i in range(kv.shape.num_layers):
                    buf = encode_layer(kv.keys[i], kv.values[i], self._config,
                                       streams=(Stream.RESIDUAL,)).buffers[Stream.RESIDUAL]
                    self._keep.append(buf)
                    self.stream.supply(region_name(i, Stream.RESIDUAL), buf,
                                       max(0.0, deadline - time.monotonic()))
            self.stream.wait(max(0.0, deadline - time.monotonic()))
        except BaseException:
            if not self.stream.done():
                self.stream.cancel()
            raise
        finally:
            if self.stream.done():
                self._keep.clear()


def send_cache(conn: Sender, prefill: Prefill, model_id: str, config: CodecConfig, *,
               request_id: str, t0_unix: float, timeout: float = 10.0,
               hold_residual: bool = False) -> CacheSend:
    """Announce, encode and supply a prefilled cache on ``conn`` (any transport's
    :class:`~lynx_transport.seam.Sender`); finish with
    :meth:`CacheSend.wait` (``prefill`` must stay unchanged until then).

    Anchors go first, layer by layer, as each is encoded. ``hold_residual``
    (LYNX; ignored for schemes without a residual): the residual lane waits for
    the receiver's ``release_lane``, and is encoded only then (in
    :meth:`CacheSend.wait`): each layer is quantized twice, but nothing of the
    residual takes CPU from the anchors' encoding, nor from the receiver's first
    decode step when both nodes share a host. Without it each layer is encoded
    once into both streams. Call :func:`warm_up_codec` once before connecting: a
    first JIT compile inside a send holds the GIL for seconds, long enough for
    the transport's peers to count its I/O threads silent.
    """
    kv = prefill.kv
    shape = kv.shape
    layer = LayerLayout.build(config, shape.kv_heads, shape.tokens, shape.head_dim)
    header = KVHeader(request_id, model_id, config.scheme, len(prefill.token_ids), t0_unix,
                      CacheLayout.of([layer] * shape.num_layers))
    deferred = hold_residual and config.scheme is Scheme.LYNX
    stream = conn.open_stream(header.regions(), metadata=header.to_metadata(), timeout=timeout,
                              hold=(Lane.RESIDUAL,) if deferred else ())
    keep: list[Any] = [np.asarray(prefill.token_ids, dtype=np.int32)]
    later: list[tuple[str, Any]] = []
    try:
        stream.supply(TOKENS, keep[0], timeout)
        for i in range(shape.num_layers):
            encoded = encode_layer(kv.keys[i], kv.values[i], config,
                                   streams=(Stream.ANCHOR,) if deferred else None)
            for s, buf in encoded.buffers.items():
                keep.append(buf)
                if s is Stream.ANCHOR:
                    stream.supply(region_name(i, s), buf, timeout)
                else:
                    later.append((region_name(i, s), buf))
        for name, buf in later:
            stream.supply(name, buf, timeout)
    except BaseException:
        if not stream.done():
            stream.cancel()
        raise
    return CacheSend(stream, prefill, config, keep, deferred)


class KVAssembler:
    """Builds the draft and full caches of one KV stream as its regions land.

    Feed it the transport callbacks of its stream (:meth:`on_region`,
    :meth:`on_failed`); read :attr:`draft` (anchor-only cache, ``None`` for
    non-LYNX schemes) and :attr:`full` (the exact cache) as futures resolving to
    :class:`KVBuffers`. ``headroom`` positions are reserved after the prompt for
    generated tokens. ``clock`` stamps :attr:`timings` (seconds on that clock).
    ``allocate(name, shape, headroom)`` supplies the ``"draft"``/``"full"`` buffers
    (default: new ones); the decode node passes buffers it prepared before asking.
    """

    def __init__(self, stream: ReceiveStream, info: ModelInfo, *, headroom: int = 64,
                 clock: Callable[[], float] = time.time,
                 allocate: Callable[[str, KVShape, int], KVBuffers] | None = None) -> None:
        self.stream = stream
        self.header = KVHeader.from_metadata(stream.metadata)
        self.shape = self.header.check_model(info)
        expected = {(n, b, lane) for n, b, lane in self.header.regions()}
        got = {(r.name, r.nbytes, r.lane) for r in stream.regions}
        if expected != got:
            raise LayoutError("the stream's regions do not match its KV header "
                              f"({len(got)} regions, {len(expected)} expected)")
        self.clock = clock
        self.scheme = self.header.scheme
        self.speculative = self.scheme is Scheme.LYNX
        self.full: cf.Future[KVBuffers] = cf.Future()
        self.draft: cf.Future[KVBuffers] | None = cf.Future() if self.speculative else None
        self.timings: dict[str, float] = {}
        self.dequant_s = 0.0
        alloc = allocate or (lambda _name, shape, room: KVBuffers(shape, headroom=room))
        self._full_kv = alloc("full", self.shape, headroom)
        self._draft_kv = alloc("draft", self.shape, headroom) if self.speculative else None
        self._landed: set[tuple[int, Stream]] = set()
        self._lock = threading.Lock()
        #: Closed: exact (residual) layers wait; see :meth:`open_full_gate`.
        self.full_gate = threading.Event()
        if not self.speculative:
            self.full_gate.set()
        self._deferred: list[tuple[int, LayerLayout]] = []
        self.token_ids: tuple[int, ...] | None = None
        self._tokens_future: cf.Future[tuple[int, ...]] = cf.Future()

    # -- callbacks (transport callback thread) ---------------------------------------------
    def on_region(self, region: ReceivedRegion) -> None:
        ended = self.stream.exception()
        if ended is not None:  # a callback queued before the stream failed: its views are gone
            self.fail(ended)
            return
        try:
            self._on_region(region)
        except LynxError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the decode thread
            self.fail(DecodeError(f"assembling region {region.name}: {type(exc).__name__}: {exc}"))

    def on_failed(self, error: TransportError) -> None:
        self.fail(error)

    def fail(self, error: BaseException) -> None:
        for future in (self._tokens_future, self.draft, self.full):
            if future is not None and not future.done():
                future.set_exception(error)
        for kv in (self._draft_kv, self._full_kv):
            if kv is not None:
                kv.abort(error)

    def filling(self, drafting: bool) -> KVBuffers:
        """The buffers the first decode step runs on while they fill (see
        ``speculative.decode_events(early=...)``): the draft cache's when
        ``drafting``, else the full cache's."""
        kv = self._draft_kv if drafting else self._full_kv
        assert kv is not None, "drafting needs a LYNX stream"
        return kv

    def prompt_ids(self, timeout: float) -> tuple[int, ...]:
        """The prompt's token ids (all of them), once the ``tokens`` region landed."""
        try:
            return self._tokens_future.result(timeout)
        except cf.TimeoutError:
            raise DecodeError(f"the prompt tokens did not arrive within {timeout} s") from None

    def _on_region(self, region: ReceivedRegion) -> None:
        view = self.stream.view(region.name)
        if region.name == TOKENS:
            ids = np.frombuffer(memoryview(view), dtype=np.int32).copy()
            if len(ids) != self.header.prompt_tokens or (ids < 0).any():
                raise DecodeError("the stream's prompt tokens are malformed")
            self.token_ids = tuple(int(t) for t in ids)
            self._tokens_future.set_result(self.token_ids)
            return
        layer, stream = _parse_name(region.name, self.shape.num_layers)
        layout = self.header.layout.layers[layer]
        with self._lock:
            self._landed.add((layer, stream))
            gate_open = self.full_gate.is_set()
            has_residual = Stream.RESIDUAL in layout.streams
            anchor_in = (layer, Stream.ANCHOR) in self._landed
            residual_in = (layer, Stream.RESIDUAL) in self._landed
        if stream is Stream.ANCHOR and self._draft_kv is not None:
            self._decode(layer, layout, self._draft_kv, residual=False)
            self._maybe_resolve(self._draft_kv, self.draft, "draft")
        if anchor_in and (residual_in or not has_residual):
            if self.speculative and not gate_open:
                with self._lock:
                    if not self.full_gate.is_set():
                        self._deferred.append((layer, layout))
                        return
            self._decode_full(layer, layout, has_residual)

    def open_full_gate(self) -> None:
        """Let exact layers be dequantized (call once the first token is out, or at once).

        LYNX dequantizes residual layers only after the gate opens, so the first
        draft step does not share CPU and memory bandwidth with rebuilding the full
        cache; layers that landed before are decoded then, on the calling thread.
        Idempotent and thread-safe."""
        with self._lock:
            if self.full_gate.is_set():
                return
            self.full_gate.set()
            pending, self._deferred = self._deferred, []
        try:
            for layer, layout in pending:
                self._decode_full(layer, layout, True)
        except LynxError as exc:
            self.fail(exc)

    def _decode_full(self, layer: int, layout: LayerLayout, residual: bool) -> None:
        self._decode(layer, layout, self._full_kv, residual=residual)
        self._maybe_resolve(self._full_kv, self.full, "full")

    def _decode(self, layer: int, layout: LayerLayout, kv: KVBuffers, *, residual: bool) -> None:
        anchor = self.stream.view(region_name(layer, Stream.ANCHOR))
        res = self.stream.view(region_name(layer, Stream.RESIDUAL)) if residual else None
        start = time.perf_counter()
        k, v = kv.layer(layer)  # decode straight into the model cache: no temporary, no copy
        decode_layer(layout, anchor, res, out_k=k, out_v=v)
        kv.mark_written(layer)
        self.dequant_s += time.perf_counter() - start

    def _maybe_resolve(self, kv: KVBuffers, future: cf.Future[KVBuffers] | None, name: str) -> None:
        if future is not None and kv.complete and not future.done():
            self.timings[f"{name}_ready"] = self.clock()
            future.set_result(kv)
