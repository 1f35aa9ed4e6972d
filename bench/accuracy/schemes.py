"""Each scheme's KV cache for the accuracy report, through the real codec.

The model's fp32 prefill cache is encoded layer by layer with
:func:`lynx_decode.codec.encode_layer` and decoded with
:func:`~lynx_decode.codec.decode_layer`, exactly as a decode node receives it:
``bf16``, ``int8`` and ``int4`` from their one plane; a LYNX split (``lynx``,
``lynx-3``, ... as :class:`~lynx_bench.sweep.config.SweepScheme`) from all its
planes (the committed cache) and from its anchor alone (the draft cache).
Lynx's committed output is INT8's by construction, so the full decode is checked
bit for bit against the INT8 scheme's (:attr:`SchemeCache.equal_to_int8`)
rather than trusted or measured again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lynx_decode import CodecConfig, Scheme, decode_layer, encode_layer

from ..sweep.config import DEFAULT_PLANES, SweepScheme

__all__ = ["Layer", "SchemeCache", "codec_layers", "scheme_cache", "REFERENCE"]

Layer = tuple[np.ndarray, np.ndarray]  # K, V [kv_heads, tokens, head_dim] fp32
#: the scheme every other one is compared with
REFERENCE = "bf16"


def codec_layers(layers: Sequence[Layer], config: CodecConfig,
                 prefixes: Sequence[int | None] = (None,)) -> list[list[Layer]]:
    """``layers`` encoded once with ``config``; per entry of ``prefixes`` the layers
    decoded from that many leading plane buffers (None: all), fp32."""
    out: list[list[Layer]] = [[] for _ in prefixes]
    for k, v in layers:
        enc = encode_layer(np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32), config)
        bufs = [enc.buffers[p] for p in range(len(enc.buffers))]
        for got, n in zip(out, prefixes):
            got.append(decode_layer(enc.layout, *bufs[: len(bufs) if n is None else n]))
    return out


@dataclass(frozen=True)
class SchemeCache:
    """One scheme's caches: ``layers`` what it decodes on (LYNX: all planes, the
    committed cache), ``draft`` LYNX's anchor-only cache (None otherwise),
    ``equal_to_int8`` whether a LYNX full decode is bitwise INT8's (None otherwise)."""

    scheme: SweepScheme
    layers: list[Layer]
    draft: list[Layer] | None = None
    equal_to_int8: bool | None = None


def _equal(a: Sequence[Layer], b: Sequence[Layer]) -> bool:
    return all(np.array_equal(ka, kb) and np.array_equal(va, vb) for (ka, va), (kb, vb) in zip(a, b))


def scheme_cache(ref: Sequence[Layer], scheme: SweepScheme, int8: Sequence[Layer] | None = None) -> SchemeCache:
    """``scheme``'s caches of the fp32 layers ``ref``; for a LYNX split ``int8`` is the
    INT8 scheme's layers to check against (computed here when None)."""
    codec = Scheme(scheme.scheme)
    if codec is not Scheme.LYNX:
        return SchemeCache(scheme, codec_layers(ref, CodecConfig(scheme=codec))[0])
    # lynx-auto has no split of its own: its committed cache is INT8's whatever it chooses,
    # and its drafts are scored on the default split's anchors
    config = CodecConfig(scheme=Scheme.LYNX, planes=scheme.planes if scheme.planes is not None else DEFAULT_PLANES)
    full, draft = codec_layers(ref, config, (None, 1))
    if int8 is None:
        int8 = codec_layers(ref, CodecConfig(scheme=Scheme.INT8))[0]
    return SchemeCache(scheme, full, draft, _equal(full, int8))
