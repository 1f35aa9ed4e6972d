"""The sending side of a KV stream: :func:`send_cache` announces a prefilled cache
(sizes known from the layout, :mod:`lynx_decode.kvheader`) and supplies its
regions; :class:`CacheSend` finishes the send.

The anchors are supplied layer after layer: a cache held encoded
(:class:`~lynx_decode.kvencode.EncodedCache`, what the prefill node sends) at
once, a :class:`Prefill` each as soon as it is encoded, so encoding overlaps the
transfer. Later planes are supplied after the last anchor, so the anchor lane
finishes first even when the encoder, not the link, is the bottleneck (and
strict lane priority orders the later planes). :func:`warm_up_codec` moves the
codec's JIT compilation to node start-up.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lynx_decode.codec import decode_layer, encode_layer, lynx_from_int8
from lynx_decode.codec.config import CodecConfig, Scheme, int8_source
from lynx_decode.codec.layout import CacheLayout, LayerLayout
from lynx_decode.errors import DecodeError
from lynx_decode.kvencode import EncodedCache, layer_kv
from lynx_decode.kvheader import TOKENS, KVHeader, lane_of, region_name
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_transport import SendStream
from lynx_transport.seam import Sender

__all__ = ["send_cache", "CacheSend", "PlaneSource", "warm_up_codec"]


def warm_up_codec(planes: tuple[int, ...] | None = None) -> None:
    """Encode and decode a tiny layer in every scheme (LYNX with ``planes``, default
    4,4), and cut LYNX planes from INT8 codes (that split and ``3,5``, the two
    ``auto`` chooses; all planes at once and one at a time), so JIT compilation
    (or loading Numba's on-disk cache) happens at node start-up, not inside a
    timed run or a send."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 70, 16), dtype=np.float32)
    for scheme in (Scheme.BF16, Scheme.INT8, Scheme.INT4, Scheme.LYNX):
        config = CodecConfig(scheme=scheme, planes=planes) if planes and scheme is Scheme.LYNX else CodecConfig(scheme)
        encoded = encode_layer(k, k, config)
        bufs = [encoded.buffers[p] for p in range(encoded.layout.num_planes)]
        for n in range(1, len(bufs) + 1):
            decode_layer(encoded.layout, *bufs[:n])
    int8 = encode_layer(k, k, CodecConfig(Scheme.INT8))
    for split in dict.fromkeys((planes or (4, 4), (3, 5))):
        config = CodecConfig(Scheme.LYNX, planes=split)
        lynx_from_int8(int8, config)
        for plane in range(len(split)):
            lynx_from_int8(int8, config, planes=(plane,))


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
    out at once. An INT8 one sent as a LYNX split (``config``'s
    :func:`~lynx_decode.codec.config.int8_source`) has each layer's planes cut
    from its codes as they are supplied
    (:func:`~lynx_decode.codec.api.lynx_from_int8`: a 4k-token layer of
    SmolLM2 in ~0.3-1 ms, both planes in one pass, the first touch of the new
    pages included; the residual supplied after the last anchor). A
    :class:`Prefill` is encoded here, layer by layer, each anchor supplied as
    soon as it is encoded. Anchors go first either way.
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
        geometry, layers, planes_of = _encoded_source(cache, model, config)
    else:
        geometry, layers, planes_of = _prefill_source(cache, model, model_id, config)
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


_Source = tuple[tuple[LayerGeometry, ...], list[LayerLayout], PlaneSource]


def _encoded_source(cache: EncodedCache, model: ModelInfo | str, config: CodecConfig) -> _Source:
    """An encoded cache's geometry, layer layouts as sent and planes: its own buffers when it was
    encoded as ``config``, else (INT8 codes sent as a LYNX split) each layer's planes cut as asked."""
    geometry = _encoded_geometry(cache, model)
    if cache.config == config:
        def held(i: int, planes: tuple[int, ...]) -> Mapping[int, Any]:
            return {p: cache.layers[i].buffers[p] for p in planes}

        return geometry, [layer.layout for layer in cache.layers], held
    if int8_source(config) != cache.config:
        raise DecodeError(f"the cache is encoded as {cache.config}, the send asks for {config}")

    def cut(i: int, planes: tuple[int, ...]) -> Mapping[int, Any]:
        return lynx_from_int8(cache.layers[i], config, planes=planes).buffers

    return geometry, [_layer_layout(config, *layer.layout.shape) for layer in cache.layers], cut


#: ``LayerLayout.build``, each (config, shape) built once: a held cache's layers are laid out
#: again on every send as a split (30 builds took ~1 ms before the first byte).
_layer_layout = functools.lru_cache(maxsize=256)(LayerLayout.build)


def _prefill_source(cache: Prefill, model: ModelInfo | str, model_id: str, config: CodecConfig) -> _Source:
    """A whole prefill's geometry, layer layouts and planes, each layer encoded as asked."""
    kv = cache.kv
    shape = kv.shape
    geometry = tuple(model.layers if isinstance(model, ModelInfo) else shape.geometry)
    if len(geometry) != shape.num_layers:
        raise DecodeError(f"the prefill has {shape.num_layers} layers, the model {model_id} {len(geometry)}")
    covered = shape.tokens
    if covered != len(cache.token_ids) - 1 or (shape.windowed and shape.layers):
        raise DecodeError("send_cache needs a whole prefill: every layer covering all prompt tokens but the last")
    layers = [LayerLayout.build(config, g.kv_heads, g.kept(covered), g.head_dim) for g in geometry]

    def encoded(i: int, planes: tuple[int, ...]) -> Mapping[int, Any]:
        k, v = layer_kv(kv, i, layers[i].tokens)
        return encode_layer(k, v, config, planes=planes).buffers

    return geometry, layers, encoded


def _encoded_geometry(cache: EncodedCache, model: ModelInfo | str) -> tuple[LayerGeometry, ...]:
    """The geometry an encoded cache is sent with, checked against ``model``."""
    if isinstance(model, ModelInfo) and tuple(model.layers) != cache.geometry:
        raise DecodeError(f"the cache was encoded for another layer geometry than the model {model.model_id}'s")
    return cache.geometry
