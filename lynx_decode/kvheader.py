"""The wire convention of a KV stream (on top of :mod:`lynx_transport`, which moves
named byte regions): its :class:`KVHeader`, the names and lanes of its regions,
and the sizes they add up to.

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

The sender is :mod:`lynx_decode.kvsend`, the receiver :mod:`lynx_decode.kvassembler`.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Sequence
from typing import Any

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.codec.layout import CacheLayout, LayerLayout
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.model.buffers import KVShape
from lynx_decode.model.geometry import LayerGeometry, geometry_from_json, geometry_json
from lynx_decode.model.identity import ModelFingerprint
from lynx_decode.model.protocol import ModelInfo
from lynx_transport import Lane

__all__ = ["KVHeader", "KV_FORMAT", "KV_VERSION", "MAX_HEADER_BYTES", "TOKENS", "region_name", "lane_of",
           "level_names", "parse_region_name", "cache_bytes", "request_id_of"]

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


def parse_region_name(name: str, layers: int, planes: int) -> tuple[int, int]:
    """``(layer, plane)`` of a region named ``L{layer}.p{plane}``; :class:`DecodeError`
    for any other name or one out of range."""
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
        obj = header_json(data)
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


def header_json(data: bytes) -> dict[str, Any]:
    """The JSON object of a KV header's metadata; :class:`LayoutError` when it is not one."""
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
        rid = header_json(data).get("request_id")
    except LayoutError:
        return None
    return rid if isinstance(rid, str) else None
