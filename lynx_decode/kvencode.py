"""A prefilled cache encoded ahead of any pull, so a pull starts sending at once.

The prefill node holds a prompt's cache in the forms its decode nodes pull (the
INT8 codes and scales, a LYNX split, ...), each an :class:`EncodedCache`:
every layer's plane buffers, for the positions the layer keeps (a sliding-window
layer its window's last ``window - 1``, see :mod:`lynx_decode.model.geometry`).
:func:`~lynx_decode.kvstream.send_cache` sends one as it is, or encodes a
:class:`~lynx_decode.model.protocol.Prefill` layer by layer on the way out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lynx_decode.codec import encode_layer
from lynx_decode.codec.api import EncodedLayer
from lynx_decode.codec.config import CodecConfig
from lynx_decode.errors import DecodeError
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.protocol import Prefill

__all__ = ["EncodedCache", "encode_cache", "layer_kv"]


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


def layer_kv(kv: KVBuffers, index: int, kept: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``index``'s K and V, only the last ``kept`` positions (contiguous)."""
    k, v = kv.layer(index)
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
