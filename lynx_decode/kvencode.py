"""A prefilled cache encoded ahead of any pull, so a pull starts sending at once.

The prefill node holds a prompt's cache in the forms its decode nodes pull (the
INT8 codes and scales, a LYNX split, ...), each an :class:`EncodedCache`:
every layer's plane buffers, for the positions the layer keeps (a sliding-window
layer its window's last ``window - 1``, see :mod:`lynx_decode.model.geometry`).
:func:`~lynx_decode.kvsend.send_cache` sends one as it is, or encodes a
:class:`~lynx_decode.model.protocol.Prefill` layer by layer on the way out.

A model whose caches arrive layer by layer from elsewhere (vLLM's producer,
:mod:`lynx_vllm.producer`) encodes each layer as it is written with
:class:`EncodeAhead`, on a thread of its own while the next layer is computed,
and offers the result to the prefill node as an :class:`EncodedSource`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lynx_decode.codec import encode_layer
from lynx_decode.codec.api import EncodedLayer
from lynx_decode.codec.config import CodecConfig
from lynx_decode.errors import DecodeError
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.protocol import Prefill

__all__ = ["EncodedCache", "EncodedSource", "EncodeAhead", "encode_cache", "layer_kv"]


@dataclass(frozen=True)
class EncodedCache:
    """A prefill's cache encoded with ``config``: ``layers[i]`` holds every plane of
    layer ``i`` over the positions ``geometry[i]`` keeps. ``encode_s``: the time
    encoding took."""

    token_ids: tuple[int, ...]
    config: CodecConfig
    geometry: tuple[LayerGeometry, ...]
    layers: tuple[EncodedLayer, ...]
    encode_s: float

    @property
    def nbytes(self) -> int:
        """Bytes held: every plane of every layer."""
        return sum(layer.wire_bytes() for layer in self.layers)


@runtime_checkable
class EncodedSource(Protocol):
    """A model that may hold a prompt's cache already encoded (the prefill node asks
    it before encoding one itself)."""

    def encoded(self, token_ids: Sequence[int], config: CodecConfig) -> EncodedCache | None:
        """The cache of ``token_ids`` encoded as ``config``, or None when not held so."""
        ...


def layer_kv(kv: KVBuffers, index: int, kept: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``index``'s K and V, only the last ``kept`` positions (contiguous)."""
    k, v = kv.layer(index)
    return _last(k, v, kept)


def _last(k: np.ndarray, v: np.ndarray, kept: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = k.shape[1]
    if kept == tokens:
        return k, v
    return np.ascontiguousarray(k[:, tokens - kept:]), np.ascontiguousarray(v[:, tokens - kept:])


def encode_cache(prefill: Prefill, geometry: Sequence[LayerGeometry], config: CodecConfig) -> EncodedCache:
    """Encode every layer of ``prefill`` (a whole prefill: each layer covering all
    prompt tokens but the last) with ``config``, each over the positions its
    ``geometry`` keeps."""
    shape = prefill.kv.shape
    covered = shape.tokens
    if len(geometry) != shape.num_layers:
        raise DecodeError(f"the prefill has {shape.num_layers} layers, the geometry {len(geometry)}")
    if covered != len(prefill.token_ids) - 1 or (shape.windowed and shape.layers):
        raise DecodeError("encode_cache needs a whole prefill: every layer covering all prompt tokens but the last")
    start = time.perf_counter()
    layers = []
    for i, g in enumerate(geometry):
        k, v = layer_kv(prefill.kv, i, g.kept(covered))
        layers.append(encode_layer(k, v, config))
    return EncodedCache(tuple(prefill.token_ids), config, tuple(geometry), tuple(layers),
                        time.perf_counter() - start)


class EncodeAhead:
    """Encodes one prompt's cache into ``configs`` layer by layer as the layers are
    written (:meth:`layer`), on ``executor`` (a thread beside the model's: the codec's
    kernels release the GIL), so the forms are ready when the last layer is.

    The arrays given to :meth:`layer` must stay unchanged until :meth:`finish`
    returned. :meth:`finish` waits for every layer and gives each form as an
    :class:`EncodedCache`; a layer that failed to encode raises there."""

    def __init__(self, token_ids: Sequence[int], geometry: Sequence[LayerGeometry],
                 configs: Sequence[CodecConfig], executor: cf.Executor) -> None:
        self.token_ids = tuple(int(t) for t in token_ids)
        self.geometry = tuple(geometry)
        self.configs = tuple(dict.fromkeys(configs))
        self._executor = executor
        self._covered = len(self.token_ids) - 1
        self._jobs: dict[int, cf.Future[tuple[list[EncodedLayer], float]]] = {}

    def layer(self, index: int, k: Any, v: Any) -> None:
        """Queue layer ``index``'s K and V (``[kv_heads, len(token_ids) - 1, head_dim]``) for encoding."""
        if not 0 <= index < len(self.geometry):
            raise DecodeError(f"layer {index} is not among the cache's {len(self.geometry)} layers")
        if index in self._jobs:
            raise DecodeError(f"layer {index} was written twice")
        kept = self.geometry[index].kept(self._covered)
        self._jobs[index] = self._executor.submit(self._encode, *_last(k, v, kept))

    def _encode(self, k: np.ndarray, v: np.ndarray) -> tuple[list[EncodedLayer], float]:
        start = time.perf_counter()
        return [encode_layer(k, v, config) for config in self.configs], time.perf_counter() - start

    def cancel(self) -> None:
        """Drop the layers not yet encoded."""
        for job in self._jobs.values():
            job.cancel()

    def finish(self) -> dict[CodecConfig, EncodedCache]:
        """Every form, once every layer is encoded (:class:`DecodeError` if one is missing)."""
        missing = [i for i in range(len(self.geometry)) if i not in self._jobs]
        if missing:
            self.cancel()
            raise DecodeError(f"layers {missing} were never written")
        done = [self._jobs[i].result() for i in range(len(self.geometry))]
        seconds = sum(s for _, s in done)
        return {config: EncodedCache(self.token_ids, config, self.geometry,
                                     tuple(layers[j] for layers, _ in done), seconds)
                for j, config in enumerate(self.configs)}
