"""KV caches as transport streams: what the prefill node sends and how the decode
node assembles it, layer by layer, as regions land.

Wire convention (on top of :mod:`lynx_transport`, which moves named byte regions):

- the stream's metadata is a :class:`KVHeader` (zlib-compressed JSON, bounded):
  model id, the model's fingerprint (:mod:`lynx_decode.model.identity`: the
  decode node refuses a cache computed by another model), scheme, the prompt
  length, the clock start ``t0_unix``, every layer's geometry (heads, head
  size, sliding window: :mod:`lynx_decode.model.geometry`) and the
  :class:`~lynx_decode.codec.layout.CacheLayout` of every layer;
- region ``tokens`` (int32 prompt ids, all of them: the cache covers
  ``ids[:-1]`` and the decode node runs the last one itself) travels first on
  ``Lane.ANCHOR``;
- region ``L{i}.p{j}`` (layer ``i``'s buffer of plane ``j``: plane 0 holds the
  packed top bits + scales, or the whole INT8/INT4/BF16 layer) on lane ``j``:
  the codec's plane table maps plane ``j`` to lane ``j`` (``Lane.ANCHOR`` is 0).

Per-layer geometry: the cache covers ``prompt_tokens - 1`` positions, and layer
``i`` carries the last ``geometry[i].kept(covered)`` of them: all for full
attention, ``window - 1`` for a sliding-window layer (all its window can still
attend to), so its regions are sized for those tokens only.

The sender announces the whole stream first (sizes are known from the layout),
then supplies the anchors layer after layer: a cache held encoded
(:class:`~lynx_decode.kvencode.EncodedCache`, what the prefill node sends) at
once, a :class:`Prefill` each as soon as it is encoded, so encoding overlaps the
transfer. Later planes are supplied after the last anchor, so the anchor lane
finishes first even when the encoder, not the link, is the bottleneck (and
strict lane priority orders the later planes).

The receiver side (:class:`KVAssembler`) runs on the transport's callback thread.
A stream of ``P`` planes builds ``P`` caches, one *level* per prefix of planes:
level ``l`` of a layer is dequantized once planes ``0..l`` of it have landed
(level 0 is the anchor-only draft, level ``P - 1`` the exact INT8 cache). One
future per level resolves when its cache is complete; a failed stream fails the
futures still pending, so the decode engine never waits past a transport error.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import json
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.codec.layout import CacheLayout, LayerLayout
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.kvencode import EncodedCache, layer_kv
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.geometry import LayerGeometry, geometry_from_json, geometry_json
from lynx_decode.model.identity import ModelFingerprint
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_decode.speculative import CacheLevel
from lynx_transport import Lane, ReceivedRegion, ReceiveStream, SendStream
from lynx_transport.errors import LynxError, TransportError
from lynx_transport.seam import Sender

__all__ = ["KVHeader", "KV_FORMAT", "send_cache", "CacheSend", "KVAssembler", "region_name", "lane_of",
           "warm_up_codec", "level_names", "cache_bytes", "request_id_of"]

KV_FORMAT = "lynx-kv-stream"
KV_VERSION = 3  # 2: one region per plane (L{i}.p{j}); 3: per-layer geometry and the model fingerprint
#: Decompressed metadata larger than this is rejected (no zip bombs).
MAX_HEADER_BYTES = 4 << 20
TOKENS = "tokens"

def region_name(layer: int, plane: int) -> str:
    return f"L{layer}.p{plane}"


def lane_of(plane: int) -> int:
    """The lane of ``plane``: the one place the plane table meets the transport."""
    return int(Lane.ANCHOR) + plane


def level_names(planes: int) -> list[str]:
    """The names of a stream's cache levels (what ``allocate`` is asked for):
    ``["full"]`` for one plane, else ``["draft", "draft1", ..., "full"]``."""
    return [("draft" if i == 0 else f"draft{i}") for i in range(planes - 1)] + ["full"]


def _parse_name(name: str, layers: int, planes: int) -> tuple[int, int]:
    head, _, tail = name.partition(".")
    try:
        layer, plane = int(head[1:]), int(tail[1:])
    except ValueError:
        raise DecodeError(f"unexpected region {name!r} in a KV stream") from None
    if not head.startswith("L") or not tail.startswith("p") or not 0 <= layer < layers or not 0 <= plane < planes:
        raise DecodeError(f"unexpected region {name!r} in a KV stream")
    return layer, plane


@dataclasses.dataclass(frozen=True)
class KVHeader:
    """What the decode node learns about a KV stream before its data arrives.

    ``geometry``: each layer's heads, head size and window (layer ``i``'s layout
    holds ``geometry[i].kept(prompt_tokens - 1)`` tokens); ``fingerprint``: the
    model that computed the cache (None: unknown, matched by ``model_id``)."""

    request_id: str
    model_id: str
    scheme: Scheme
    prompt_tokens: int
    t0_unix: float
    layout: CacheLayout
    geometry: tuple[LayerGeometry, ...] = ()
    fingerprint: ModelFingerprint | None = None

    def __post_init__(self) -> None:
        if not self.geometry:
            object.__setattr__(self, "geometry", tuple(
                LayerGeometry(layer.kv_heads, layer.head_dim) for layer in self.layout.layers))

    @property
    def cached_tokens(self) -> int:
        """Positions the cache covers (all prompt tokens but the last)."""
        return self.prompt_tokens - 1

    def to_metadata(self) -> bytes:
        obj = {"format": KV_FORMAT, "version": KV_VERSION, "request_id": self.request_id,
               "model_id": self.model_id,
               "fingerprint": None if self.fingerprint is None else self.fingerprint.to_json(),
               "scheme": self.scheme.value, "prompt_tokens": self.prompt_tokens,
               "t0_unix": self.t0_unix, "geometry": geometry_json(self.geometry),
               "layout": self.layout.to_bytes().decode()}
        return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 6)

    @classmethod
    def from_metadata(cls, data: bytes) -> KVHeader:
        """Parse and validate; :class:`LayoutError` on anything malformed."""
        obj = _header_json(data)
        if obj.get("version") != KV_VERSION:
            raise LayoutError(f"KV header version {obj.get('version')!r} is not supported "
                              f"(this build reads {KV_VERSION})")
        try:
            scheme = Scheme(obj["scheme"])
            tokens, t0 = obj["prompt_tokens"], obj["t0_unix"]
            model_id, layout_text = obj["model_id"], obj["layout"]
            request_id = obj["request_id"]
            geometry = geometry_from_json(obj["geometry"])
            raw_fp = obj["fingerprint"]
        except (KeyError, ValueError) as exc:
            raise LayoutError(f"KV header field is missing or invalid: {exc}") from None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
            raise LayoutError(f"KV header prompt_tokens must be an int >= 2, got {tokens!r}")
        if not isinstance(t0, (int, float)) or not isinstance(model_id, str) \
                or not isinstance(layout_text, str) or not isinstance(request_id, str):
            raise LayoutError("KV header fields have the wrong types")
        fingerprint = None if raw_fp is None else ModelFingerprint.from_json(raw_fp)
        layout = CacheLayout.from_bytes(layout_text.encode())
        header = cls(request_id, model_id, scheme, tokens, float(t0), layout, geometry, fingerprint)
        if len(geometry) != len(layout.layers):
            raise LayoutError(f"the KV header describes {len(geometry)} layers, its layout {len(layout.layers)}")
        covered = tokens - 1
        for i, (layer, g) in enumerate(zip(layout.layers, geometry)):
            if layer.scheme is not scheme:
                raise LayoutError(f"layer {i} is {layer.scheme.value}, the header says {scheme.value}")
            if layer.num_planes != layout.layers[0].num_planes:
                raise LayoutError(f"layer {i} has {layer.num_planes} planes, layer 0 {layout.layers[0].num_planes}")
            if (layer.kv_heads, layer.head_dim) != (g.kv_heads, g.head_dim):
                raise LayoutError(f"layer {i} has shape {layer.shape}, its geometry says {g.describe()}")
            if layer.tokens != g.kept(covered):
                raise LayoutError(f"layer {i} caches {layer.tokens} tokens; a prompt of {tokens} tokens "
                                  f"needs {g.kept(covered)} ({g.describe()})")
        return header

    def check_model(self, info: ModelInfo) -> KVShape:
        """The shape of the cache this stream builds, or :class:`DecodeError` if the
        stream does not fit ``info``: computed by another model (fingerprint, or
        ``model_id`` when either side has none), another layer geometry, or a
        prompt past the model's positions. The message names both models."""
        mine, theirs = info.fingerprint, self.fingerprint
        if mine is not None and theirs is not None:
            differ = theirs.differences(mine)
            if differ:
                raise DecodeError(
                    f"the KV cache was computed by the model {theirs.short()}, but this decode node "
                    f"runs {mine.short()}: they differ in their {' and '.join(differ)}: a cache is "
                    f"valid only for the model that computed it{self._geometry_note(info)}")
        elif self.model_id != info.model_id:
            raise DecodeError(f"the KV cache was computed by the model {self.model_id!r}, but this "
                              f"decode node runs {info.model_id!r}{self._geometry_note(info)}")
        problem = self._geometry_problem(info)
        if problem is not None:
            raise DecodeError(f"the KV cache from the model {self.model_id!r} does not fit this decode "
                              f"node's model: {problem}")
        if self.prompt_tokens > info.max_positions:
            raise DecodeError(f"the stream's prompt has {self.prompt_tokens} tokens, more than the "
                              f"model's {info.max_positions} positions")
        return KVShape.of(self.geometry, self.cached_tokens)

    def _geometry_problem(self, info: ModelInfo) -> str | None:
        g0, m0 = self.geometry[0], info.layers[0]
        summary = (f"the stream's layout (layers, kv_heads, head_dim) = "
                   f"{(len(self.geometry), g0.kv_heads, g0.head_dim)} does not match the model "
                   f"{info.model_id}: {(info.num_layers, m0.kv_heads, m0.head_dim)}")
        if len(self.geometry) != info.num_layers:
            return summary
        for i, (got, want) in enumerate(zip(self.geometry, info.layers)):
            # a sliding layer may come whole (window None): the model then masks the window
            if (got.kv_heads, got.head_dim) != (want.kv_heads, want.head_dim) or \
                    (got.window is not None and got.window != want.window):
                return f"{summary}; layer {i} is {got.describe()} in the stream, {want.describe()} in the model"
        return None

    def _geometry_note(self, info: ModelInfo) -> str:
        problem = self._geometry_problem(info)
        return "" if problem is None else f" (and the shapes differ: {problem})"

    @property
    def num_planes(self) -> int:
        return self.layout.num_planes

    def regions(self) -> list[tuple[str, int, int]]:
        """``(name, nbytes, lane)`` of every region, plane by plane (anchors first), each in layer order."""
        out = [(TOKENS, 4 * self.prompt_tokens, int(Lane.ANCHOR))]
        for plane in range(self.num_planes):
            for i, layer in enumerate(self.layout.layers):
                out.append((region_name(i, plane), layer.plane_size(plane), lane_of(plane)))
        return out

    def naive_bytes(self) -> int:
        """Bytes of the same stream with every layer whole (no window): what a
        transfer of the full per-layer cache would have sent."""
        config = self.layout.layers[0].config
        full = [dataclasses.replace(g, window=None) for g in self.geometry]
        return 4 * self.prompt_tokens + cache_bytes(full, self.cached_tokens, config)


def cache_bytes(geometry: Sequence[LayerGeometry], covered: int, config: CodecConfig,
                planes: Sequence[int] | None = None) -> int:
    """Bytes of the encoded layers of a cache covering ``covered`` positions (each
    layer its kept tokens), on ``planes`` (default: all)."""
    total = 0
    for g in geometry:
        layer = LayerLayout.build(config, g.kv_heads, g.kept(covered), g.head_dim)
        total += sum(layer.plane_size(p) for p in (planes if planes is not None else range(layer.num_planes)))
    return total


def _header_json(data: bytes) -> dict[str, Any]:
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
    return obj


def request_id_of(data: bytes) -> str | None:
    """The request id of a KV header, even of one too malformed to accept (so its
    request hears why), or None when there is none to read."""
    try:
        rid = _header_json(data).get("request_id")
    except LayoutError:
        return None
    return rid if isinstance(rid, str) else None


def warm_up_codec(planes: tuple[int, ...] | None = None) -> None:
    """Encode and decode a tiny layer in every scheme (LYNX with ``planes``, default
    4,4), so JIT compilation (or loading Numba's on-disk cache) happens at node
    start-up, not inside a timed run."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 70, 16), dtype=np.float32)
    for scheme in (Scheme.BF16, Scheme.INT8, Scheme.INT4, Scheme.LYNX):
        config = CodecConfig(scheme=scheme, planes=planes) if planes and scheme is Scheme.LYNX else CodecConfig(scheme)
        encoded = encode_layer(k, k, config)
        bufs = [encoded.buffers[p] for p in range(encoded.layout.num_planes)]
        for n in range(1, len(bufs) + 1):
            decode_layer(encoded.layout, *bufs[:n])


#: Layer ``i``'s buffers of the given planes (encoded now, or taken from a held encoding).
PlaneSource = Callable[[int, tuple[int, ...]], Mapping[int, Any]]


class CacheSend:
    """A cache on its way out (from :func:`send_cache`): :attr:`stream`, and
    :meth:`wait`, which finishes the send. It keeps the encoded buffers alive
    until the stream is done."""

    def __init__(self, stream: SendStream, planes_of: PlaneSource, layers: int, later: tuple[int, ...],
                 keep: list[Any], deferred: bool, first_supplied_s: float) -> None:
        self.stream = stream
        self._planes_of = planes_of
        self._layers = layers
        self._later = later
        self._keep = keep
        self._deferred = deferred
        #: seconds from the call to :func:`send_cache` until the first anchor region was supplied
        self.first_supplied_s = first_supplied_s

    def wait(self, timeout: float) -> None:
        """Finish the send within ``timeout`` seconds: for held planes, wait for the
        receiver to release them, then supply them layer by layer (encoding them
        now unless the cache came encoded); then wait for the receiver's
        confirmation of the whole stream. Raises the stream's error, or
        ``TransportTimeoutError``; a failed send is cancelled."""
        deadline = time.monotonic() + timeout
        try:
            if self._deferred:
                self._deferred = False
                for plane in self._later:
                    self.stream.wait_released(lane_of(plane), max(0.0, deadline - time.monotonic()))
                for i in range(self._layers):
                    buffers = self._planes_of(i, self._later)
                    for plane in self._later:
                        buf = buffers[plane]
                        self._keep.append(buf)
                        self.stream.supply(region_name(i, plane), buf, max(0.0, deadline - time.monotonic()))
            self.stream.wait(max(0.0, deadline - time.monotonic()))
        except BaseException:
            if not self.stream.done():
                self.stream.cancel()
            raise
        finally:
            if self.stream.done():
                self._keep.clear()


def send_cache(conn: Sender, cache: Prefill | EncodedCache, model: ModelInfo | str, config: CodecConfig, *,
               request_id: str, t0_unix: float, timeout: float = 10.0,
               hold_residual: bool = False) -> CacheSend:
    """Announce and supply a prefilled cache on ``conn`` (any transport's
    :class:`~lynx_transport.seam.Sender`); finish with :meth:`CacheSend.wait`
    (``cache`` must stay unchanged until then).

    ``cache``: an :class:`~lynx_decode.kvencode.EncodedCache` (encoded with
    ``config`` for ``model``'s geometry) is sent as it is: the first anchor goes
    out at once. A :class:`Prefill` is encoded here, layer by layer, each anchor
    supplied as soon as it is encoded. Anchors go first either way.
    ``hold_residual`` (LYNX; ignored for one-plane schemes): the lanes of planes
    1.. wait for the receiver's ``release_lane``; a prefill's later planes are
    encoded only then (in :meth:`CacheSend.wait`): each layer is quantized twice,
    but nothing of them takes CPU from the anchors' encoding, nor from the
    receiver's first decode step when both nodes share a host. Without it each
    layer is encoded once into every plane. Call :func:`warm_up_codec` once
    before connecting: a first JIT compile inside a send holds the GIL for
    seconds, long enough for the transport's peers to count its I/O threads silent.

    ``model``: the model that computed the cache. Its :class:`ModelInfo` puts its
    fingerprint on the wire and sends each sliding-window layer's last
    ``window - 1`` positions only; a bare model id sends every layer whole and
    no fingerprint (the decode node then matches the id).
    """
    called = time.perf_counter()
    if isinstance(model, ModelInfo):
        model_id, fingerprint = model.model_id, model.fingerprint
    else:
        model_id, fingerprint = model, None
    if isinstance(cache, EncodedCache):
        geometry = _encoded_geometry(cache, model, config)
        layers = [layer.layout for layer in cache.layers]

        def planes_of(i: int, planes: tuple[int, ...]) -> Mapping[int, Any]:
            return {p: cache.layers[i].buffers[p] for p in planes}
    else:
        kv = cache.kv
        shape = kv.shape
        geometry = model.layers if isinstance(model, ModelInfo) else shape.geometry
        if len(geometry) != shape.num_layers:
            raise DecodeError(f"the prefill has {shape.num_layers} layers, the model {model_id} {len(geometry)}")
        covered = shape.tokens
        if covered != len(cache.token_ids) - 1 or (shape.windowed and shape.layers):
            raise DecodeError("send_cache needs a whole prefill: every layer covering all prompt tokens but the last")
        layers = [LayerLayout.build(config, g.kv_heads, g.kept(covered), g.head_dim) for g in geometry]

        def planes_of(i: int, planes: tuple[int, ...]) -> Mapping[int, Any]:
            k, v = layer_kv(kv, i, layers[i].tokens)
            return encode_layer(k, v, config, planes=planes).buffers
    header = KVHeader(request_id, model_id, config.scheme, len(cache.token_ids), t0_unix,
                      CacheLayout.of(layers), tuple(geometry), fingerprint)
    num_planes = layers[0].num_planes
    deferred = hold_residual and num_planes > 1
    later = tuple(range(1, num_planes))
    held = tuple(lane_of(p) for p in later) if deferred else ()
    stream = conn.open_stream(header.regions(), metadata=header.to_metadata(), timeout=timeout, hold=held)
    keep: list[Any] = [np.asarray(cache.token_ids, dtype=np.int32)]
    first_supplied = 0.0
    try:
        stream.supply(TOKENS, keep[0], timeout)
        rest: list[tuple[str, Any]] = []
        for i in range(len(layers)):
            buffers = planes_of(i, (0,) if deferred else (0, *later))
            for plane, buf in buffers.items():
                keep.append(buf)
                if plane == 0:
                    stream.supply(region_name(i, plane), buf, timeout)
                    if i == 0:
                        first_supplied = time.perf_counter() - called
                else:
                    rest.append((region_name(i, plane), buf))
        for name, buf in rest:
            stream.supply(name, buf, timeout)
    except BaseException:
        if not stream.done():
            stream.cancel()
        raise
    return CacheSend(stream, planes_of, len(layers), later, keep, deferred, first_supplied)


def _encoded_geometry(cache: EncodedCache, model: ModelInfo | str,
                      config: CodecConfig) -> tuple[LayerGeometry, ...]:
    """The geometry an encoded cache is sent with, checked against ``model`` and ``config``."""
    if cache.config != config:
        raise DecodeError(f"the cache is encoded as {cache.config}, the send asks for {config}")
    if isinstance(model, ModelInfo) and tuple(model.layers) != cache.geometry:
        raise DecodeError(f"the cache was encoded for another layer geometry than the model {model.model_id}'s")
    return cache.geometry


class KVAssembler:
    """Builds the caches of one KV stream, one per level (prefix of planes), as its
    regions land.

    Feed it the transport callbacks of its stream (:meth:`on_region`,
    :meth:`on_failed`); read :attr:`levels` (for the decode engine), or
    :attr:`draft` (the anchor-only cache, ``None`` for one-plane schemes) and
    :attr:`full` (the exact cache) as futures resolving to :class:`KVBuffers`.
    ``headroom`` positions are reserved after the prompt for generated tokens.
    ``clock`` stamps :attr:`timings` and the arrivals (seconds on that clock).
    ``allocate(name, shape, headroom)`` supplies each level's buffers (names from
    :func:`level_names`; default: new ones); the decode node passes buffers it
    prepared before asking. ``prior_gbps``: the link rate expected (asked for, or
    seen on the connection's earlier streams), for :meth:`eta` until the stream's
    own arrivals give one.
    """

    def __init__(self, stream: ReceiveStream, info: ModelInfo, *, headroom: int = 64,
                 clock: Callable[[], float] = time.time,
                 allocate: Callable[[str, KVShape, int], KVBuffers] | None = None,
                 prior_gbps: float | None = None) -> None:
        self.stream = stream
        self.prior_gbps = prior_gbps
        self.header = KVHeader.from_metadata(stream.metadata)
        self.shape = self.header.check_model(info)
        expected = {(n, b, lane) for n, b, lane in self.header.regions()}
        got = {(r.name, r.nbytes, r.lane) for r in stream.regions}
        if expected != got:
            raise LayoutError("the stream's regions do not match its KV header "
                              f"({len(got)} regions, {len(expected)} expected)")
        self.clock = clock
        self.scheme = self.header.scheme
        self.num_planes = self.header.num_planes
        self.speculative = self.num_planes > 1
        self.names = level_names(self.num_planes)
        self._futures: list[cf.Future[KVBuffers]] = [cf.Future() for _ in self.names]
        self.full = self._futures[-1]
        self.draft: cf.Future[KVBuffers] | None = self._futures[0] if self.speculative else None
        self.timings: dict[str, float] = {}
        self.dequant_s = 0.0
        alloc = allocate or (lambda _name, shape, room: KVBuffers(shape, headroom=room))
        self._kv = [alloc(name, self.shape, headroom) for name in self.names]
        layers = self.shape.num_layers
        self._landed = np.zeros((self.num_planes, layers), dtype=bool)
        self._claimed = np.zeros((self.num_planes, layers), dtype=bool)  # level l of layer i taken for decoding
        self._arrivals: list[list[float]] = [[] for _ in range(self.num_planes)]
        #: bytes of each region, [plane][layer] (a sliding layer's are its window's)
        self.layer_bytes = [[layer.plane_size(p) for layer in self.header.layout.layers]
                            for p in range(self.num_planes)]
        self._first_arrival: float | None = None
        self._last_arrival: float | None = None
        self._bytes_after_first = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a region landed, a layer was decoded, a failure
        self._failed = False
        #: Closed: levels above the anchor wait; see :meth:`open_full_gate`.
        self.full_gate = threading.Event()
        if not self.speculative:
            self.full_gate.set()
        self._deferred: list[tuple[int, int]] = []
        self.token_ids: tuple[int, ...] | None = None
        self._tokens_future: cf.Future[tuple[int, ...]] = cf.Future()

    @property
    def levels(self) -> list[CacheLevel]:
        """The caches the decode engine drafts on and verifies against, coarsest
        first: each with its future, its buffers while they fill, and an estimate
        of when it completes."""
        return [CacheLevel(future, kv, functools.partial(self.eta, level), functools.partial(self.take, level))
                for level, (future, kv) in enumerate(zip(self._futures, self._kv))]

    def take(self, level: int, layer: int, timeout: float = 0.0) -> bool:
        """Make layer ``layer`` of level ``level`` readable if its planes land within
        ``timeout`` seconds (0: only if they are in now): one the gate held back
        (:meth:`open_full_gate`) is dequantized here, on the calling thread, the
        engine's, which is about to read it. True when it is readable; False when
        its bytes did not all come in time, or the stream failed."""
        kv = self._kv[level]
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if kv.written(layer):
                    return True
                if (layer, level) in self._deferred:
                    self._deferred.remove((layer, level))
                    break
                left = deadline - time.monotonic()
                if self._failed or left <= 0:
                    return False
                self._changed.wait(left)  # (a layer another thread decodes notifies when written)
        self._decode_level(layer, level)
        return True

    def eta(self, level: int) -> float | None:
        """Seconds until every region of planes ``0..level`` has landed: the bytes still
        missing over the stream's arrival rate so far (bytes landed after the first
        region over the time since it; a held lane's wait counts as time, so this
        errs late). 0 when in; None before two regions landed."""
        with self._lock:
            first, last, landed = self._first_arrival, self._last_arrival, self._bytes_after_first
            missing = sum(int(np.dot(~self._landed[p], self.layer_bytes[p])) for p in range(level + 1))
        if missing == 0:
            return 0.0
        if first is None or last is None or last <= first or landed <= 0:
            return None if self.prior_gbps is None else missing * 8 / (self.prior_gbps * 1e9)
        rate = landed / (self.clock() - first)
        return missing / rate

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
        with self._changed:
            self._failed = True
            self._changed.notify_all()
        futures: list[cf.Future[Any]] = [self._tokens_future, *self._futures]
        for future in futures:
            if not future.done():
                with contextlib.suppress(cf.InvalidStateError):  # resolved meanwhile: it stands
                    future.set_exception(error)
        for kv in self._kv:
            kv.abort(error)

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
        layer, plane = _parse_name(region.name, self.shape.num_layers, self.num_planes)
        now = self.clock()
        ready = []
        with self._lock:
            self._landed[plane, layer] = True
            self._arrivals[plane].append(now)
            if len(self._arrivals[plane]) == 1:
                self.timings[f"plane{plane}_first"] = now
            if self._first_arrival is None:
                self._first_arrival = now
            else:
                self._bytes_after_first += self.layer_bytes[plane][layer]
            self._last_arrival = now
            gate_open = self.full_gate.is_set()
            for level in range(self.num_planes):
                if self._claimed[level, layer] or not self._landed[: level + 1, layer].all():
                    continue
                if level > 0 and not gate_open:
                    self._claimed[level, layer] = True
                    self._deferred.append((layer, level))
                    continue
                self._claimed[level, layer] = True
                ready.append(level)
            self._changed.notify_all()
        for level in ready:
            self._decode_level(layer, level)

    def open_full_gate(self) -> None:
        """Let the levels above the anchor be dequantized (call once the first token
        is out, or at once).

        A multi-plane stream dequantizes levels 1.. only after the gate opens, so
        the first draft step does not share CPU and memory bandwidth with
        rebuilding the finer caches; layers that landed before are decoded then,
        on the calling thread, level by level. Idempotent and thread-safe."""
        with self._lock:
            if self.full_gate.is_set():
                return
            self.full_gate.set()
            pending, self._deferred = self._deferred, []
        try:
            for layer, level in sorted(pending, key=lambda p: (p[1], p[0])):
                self._decode_level(layer, level)
        except LynxError as exc:
            self.fail(exc)

    def _decode_level(self, layer: int, level: int) -> None:
        layout = self.header.layout.layers[layer]
        kv = self._kv[level]
        bufs = [self.stream.view(region_name(layer, p)) for p in range(level + 1)]
        start = time.perf_counter()
        k, v = kv.layer(layer)  # decode straight into the model cache: no temporary, no copy
        decode_layer(layout, *bufs, out_k=k, out_v=v)
        kv.mark_written(layer)
        future = self._futures[level]
        with self._lock:  # two threads may finish layers of one level (callbacks, the gate's opener)
            self._changed.notify_all()
            self.dequant_s += time.perf_counter() - start
            if not kv.complete or future.done():
                return
            self.timings[f"{self.names[level]}_ready"] = self.clock()
            future.set_result(kv)
