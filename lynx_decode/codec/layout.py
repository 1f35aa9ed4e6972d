"""The layout descriptor: where every region of every layer sits on its plane.

A :class:`CacheLayout` is what the prefill node sends ahead of the bytes (the
transport carries it in its manifest) so the decode node can register receive
memory and decode each layer as it lands. It is versioned, serialises to compact
JSON (:meth:`CacheLayout.to_bytes`), and :meth:`CacheLayout.from_bytes` accepts
only descriptors that are exactly consistent: every region must be where
:meth:`LayerLayout.build` would put it for the layer's scheme, planes, shapes and
group sizes. Anything else raises :class:`LayoutError` naming the problem.

Per layer, each plane (:mod:`~lynx_decode.codec.config`'s plane table) carries
one contiguous buffer; inside it regions start at multiples of :data:`ALIGN`
bytes (zero padding between). Plane 0 holds ``k_data``/``v_data`` (INT8 codes,
packed INT4 codes, or LYNX's packed top plane) and the four scale/zero grids;
LYNX plane ``i >= 1`` holds ``k_plane{i}``/``v_plane{i}``. In the cache, layer
``i``'s buffer of plane ``p`` starts at ``offsets[i][p]``, also aligned.
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from lynx_decode.codec.config import MAX_PLANES, CodecConfig, Plane, Scheme, Split, check_planes, plane_table
from lynx_decode.codec.pack import packed_size
from lynx_decode.errors import CodecError, LayoutError

__all__ = ["DType", "Region", "LayerLayout", "CacheLayout", "FORMAT_VERSION", "ALIGN", "MAX_DESCRIPTOR_BYTES",
           "plane_region"]

FORMAT_VERSION = 2  # 2: the plane table (planes, region planes) replaces bits/streams
FORMAT_NAME = "lynx-kv-layout"
ALIGN = 64
MAX_DESCRIPTOR_BYTES = 4 << 20
MAX_LAYERS = 4096
MAX_HEADS = 1024
MAX_TOKENS = 1 << 22
MAX_HEAD_DIM = 4096
MAX_STREAM_BYTES = 1 << 40


class DType(enum.Enum):
    """Element type of a region."""

    UINT8 = "uint8"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def itemsize(self) -> int:
        return 1 if self is DType.UINT8 else 2


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Region:
    """A named byte range of one layer's buffer on one plane.

    ``bits`` is the width of each value: 16 for float regions, 8 for plain INT8
    codes, the packed width for bit-packed regions (whose ``shape`` is their byte
    count).
    """

    name: str
    plane: int
    offset: int
    size: int
    dtype: DType
    shape: tuple[int, ...]
    bits: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "plane": self.plane,
            "offset": self.offset,
            "size": self.size,
            "dtype": self.dtype.value,
            "shape": list(self.shape),
            "bits": self.bits,
        }


def plane_region(kind: str, plane: int) -> str:
    """The name of tensor ``kind``'s ("k"/"v") region on ``plane``."""
    return f"{kind}_data" if plane == 0 else f"{kind}_plane{plane}"


def _regions(
    scheme: Scheme, planes: tuple[int, ...], heads: int, tokens: int, dim: int, k_group: int, v_group: int
) -> tuple[Region, ...]:
    n = heads * tokens * dim
    specs: list[tuple[str, int, DType, tuple[int, ...], int, int]] = []  # name, plane, dtype, shape, bits, size
    table = plane_table(scheme, planes)

    def packed(name: str, plane: int, width: int) -> None:
        size = packed_size(n, width)
        specs.append((name, plane, DType.UINT8, (size,), width, size))

    if scheme in (Scheme.BF16, Scheme.FP16):
        dtype = DType.BFLOAT16 if scheme is Scheme.BF16 else DType.FLOAT16
        for name in ("k_data", "v_data"):
            specs.append((name, 0, dtype, (heads, tokens, dim), 16, 2 * n))
    else:
        if scheme is Scheme.INT8:
            for name in ("k_data", "v_data"):
                specs.append((name, 0, DType.UINT8, (heads, tokens, dim), 8, n))
        else:
            packed("k_data", 0, table[0].bits)
            packed("v_data", 0, table[0].bits)
        k_shape = (heads, -(-tokens // k_group), dim)
        v_shape = (heads, tokens, -(-dim // v_group))
        for name, grid in (("k_scale", k_shape), ("k_zero", k_shape), ("v_scale", v_shape), ("v_zero", v_shape)):
            specs.append((name, 0, DType.FLOAT16, grid, 16, 2 * grid[0] * grid[1] * grid[2]))
        for plane in table[1:]:
            packed(plane_region("k", plane.index), plane.index, plane.bits)
            packed(plane_region("v", plane.index), plane.index, plane.bits)
    cursor = [0] * len(table)
    out = []
    for name, plane_index, dtype, shape, width, size in specs:
        offset = _align(cursor[plane_index])
        out.append(Region(name, plane_index, offset, size, dtype, shape, width))
        cursor[plane_index] = offset + size
    return tuple(out)


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{what} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise LayoutError(f"{what}={value} is out of range [{lo}, {hi}]")
    return value


def _enum(cls: Any, value: Any, what: str) -> Any:
    try:
        return value if isinstance(value, cls) else cls(value)
    except ValueError:
        raise LayoutError(f"unknown {what} {value!r}; expected one of {[m.value for m in cls]}") from None


@dataclass(frozen=True)
class LayerLayout:
    """One layer: its scheme, plane table, shapes and the regions of its buffers."""

    scheme: Scheme
    planes: tuple[int, ...]
    split: Split
    kv_heads: int
    tokens: int
    head_dim: int
    k_group: int
    v_group: int
    regions: tuple[Region, ...]

    @classmethod
    def build(cls, config: CodecConfig, kv_heads: int, tokens: int, head_dim: int) -> LayerLayout:
        """The layout of a ``[kv_heads, tokens, head_dim]`` layer encoded with ``config``."""
        _int(kv_heads, "kv_heads", 1, MAX_HEADS)
        _int(tokens, "tokens", 1, MAX_TOKENS)
        _int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
        regions = _regions(config.scheme, config.planes, kv_heads, tokens, head_dim, config.k_group, config.v_group)
        return cls(
            config.scheme, config.planes, config.split, kv_heads, tokens, head_dim,
            config.k_group, config.v_group, regions,
        )

    @property
    def config(self) -> CodecConfig:
        return CodecConfig(self.scheme, k_group=self.k_group, v_group=self.v_group, split=self.split,
                           planes=self.planes)

    @property
    def bits(self) -> int:
        """The anchor width (LYNX's first plane; it also shapes a ``Split.ROUNDED`` grid)."""
        return self.planes[0]

    @property
    def plane_table(self) -> tuple[Plane, ...]:
        """The planes this layer has a buffer on (plane 0 first)."""
        return plane_table(self.scheme, self.planes)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.kv_heads, self.tokens, self.head_dim)

    @property
    def num_planes(self) -> int:
        return len(self.plane_table)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise LayoutError(f"layer has no region {name!r} (scheme {self.scheme.value})")

    def plane_size(self, plane: int) -> int:
        """Bytes of this layer's buffer on ``plane`` (0 when it has none)."""
        return self._plane_sizes[plane] if 0 <= plane < MAX_PLANES else 0

    @functools.cached_property
    def _plane_sizes(self) -> tuple[int, ...]:  # once per (frozen) layout
        return tuple(max((r.offset + r.size for r in self.regions if r.plane == p), default=0)
                     for p in range(MAX_PLANES))

    def validate(self) -> None:
        """Raise :class:`LayoutError` unless this layout is exactly what :meth:`build` gives."""
        _enum(Scheme, self.scheme, "scheme")
        _enum(Split, self.split, "split")
        try:
            check_planes(self.planes)
        except CodecError as exc:
            raise LayoutError(str(exc)) from None
        for name in ("k_group", "v_group"):
            _int(getattr(self, name), name, 1, 1 << 16)
        try:
            expected = LayerLayout.build(self.config, self.kv_heads, self.tokens, self.head_dim)
        except CodecError as exc:
            raise LayoutError(str(exc)) from None
        if len(self.regions) != len(expected.regions):
            raise LayoutError(
                f"{self.scheme.value} layer needs {len(expected.regions)} regions, descriptor has {len(self.regions)}"
            )
        for got, want in zip(self.regions, expected.regions):
            if got != want:
                fields = ("name", "plane", "offset", "size", "dtype", "shape", "bits")
                diff = [f for f in fields if getattr(got, f) != getattr(want, f)]
                raise LayoutError(
                    f"region {got.name!r} is inconsistent with a {self.scheme.value} layer of shape {self.shape}, "
                    f"planes={list(self.planes)}, groups=({self.k_group}, {self.v_group}): bad {', '.join(diff)} "
                    f"(got {[getattr(got, f) for f in diff]}, expected {[getattr(want, f) for f in diff]})"
                )

    def to_json(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme.value,
            "planes": list(self.planes),
            "split": self.split.value,
            "kv_heads": self.kv_heads,
            "tokens": self.tokens,
            "head_dim": self.head_dim,
            "k_group": self.k_group,
            "v_group": self.v_group,
            "regions": [r.to_json() for r in self.regions],
        }

    @classmethod
    def from_json(cls, obj: Any) -> LayerLayout:
        """Parse and validate one layer (``LayoutError`` on anything inconsistent)."""
        d = _fields(
            obj, "layer",
            ("scheme", "planes", "split", "kv_heads", "tokens", "head_dim", "k_group", "v_group", "regions"),
        )
        raw = d["regions"]
        if not isinstance(raw, list) or len(raw) > 6 + 2 * MAX_PLANES:
            raise LayoutError(f"layer regions must be a list of at most {6 + 2 * MAX_PLANES} regions")
        regions = []
        for item in raw:
            r = _fields(item, "region", ("name", "plane", "offset", "size", "dtype", "shape", "bits"))
            if not isinstance(r["name"], str) or len(r["name"]) > 64:
                raise LayoutError(f"region name must be a short string, got {r['name']!r}")
            shape = r["shape"]
            if not isinstance(shape, list) or not 1 <= len(shape) <= 3:
                raise LayoutError(f"region {r['name']!r} shape must be a list of 1..3 ints, got {shape!r}")
            regions.append(
                Region(
                    r["name"],
                    _int(r["plane"], f"region {r['name']!r} plane", 0, MAX_PLANES - 1),
                    _int(r["offset"], f"region {r['name']!r} offset", 0, MAX_STREAM_BYTES),
                    _int(r["size"], f"region {r['name']!r} size", 0, MAX_STREAM_BYTES),
                    _enum(DType, r["dtype"], "dtype"),
                    tuple(_int(s, f"region {r['name']!r} shape", 0, MAX_STREAM_BYTES) for s in shape),
                    _int(r["bits"], f"region {r['name']!r} bits", 1, 16),
                )
            )
        planes = d["planes"]
        if not isinstance(planes, list) or not 1 <= len(planes) <= MAX_PLANES:
            raise LayoutError(f"layer planes must be a list of 1..{MAX_PLANES} widths, got {planes!r}")
        layer = cls(
            _enum(Scheme, d["scheme"], "scheme"),
            tuple(_int(w, "plane width", 0, 8) for w in planes),
            _enum(Split, d["split"], "split"),
            _int(d["kv_heads"], "kv_heads", 1, MAX_HEADS),
            _int(d["tokens"], "tokens", 1, MAX_TOKENS),
            _int(d["head_dim"], "head_dim", 1, MAX_HEAD_DIM),
            _int(d["k_group"], "k_group", 1, 1 << 16),
            _int(d["v_group"], "v_group", 1, 1 << 16),
            tuple(regions),
        )
        layer.validate()
        return layer


def _fields(obj: Any, what: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise LayoutError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    extra = [k for k in obj if k not in keys]
    if missing or extra:
        raise LayoutError(f"{what} has missing fields {missing} / unknown fields {extra}")
    return obj


@dataclass(frozen=True)
class CacheLayout:
    """All layers of a cache, and where each layer's buffer sits on each plane."""

    layers: tuple[LayerLayout, ...]
    offsets: tuple[tuple[int, ...], ...] = field(default=())
    version: int = FORMAT_VERSION

    @classmethod
    def of(cls, layers: Any) -> CacheLayout:
        """Place ``layers`` one after another on each plane (aligned). Equal layers (a
        model's mostly are) become one object, which :meth:`validate` checks once."""
        interned: dict[LayerLayout, LayerLayout] = {}
        layers = tuple(interned.setdefault(layer, layer) for layer in layers)
        cursor = [0] * MAX_PLANES
        offsets = []
        for layer in layers:
            placed = []
            for plane in range(layer.num_planes):
                placed.append(cursor[plane])
                cursor[plane] = _align(cursor[plane] + layer.plane_size(plane))
            offsets.append(tuple(placed))
        out = cls(layers, tuple(offsets))
        out.validate()
        return out

    @property
    def num_planes(self) -> int:
        return max(layer.num_planes for layer in self.layers)

    def offset(self, layer: int, plane: int) -> int:
        """Byte offset of layer ``layer``'s buffer in the cache's ``plane``."""
        offs = self.offsets[layer]
        if not 0 <= plane < len(offs):
            raise LayoutError(f"layer {layer} has no buffer on plane {plane}")
        return offs[plane]

    def span(self, layer: int, plane: int) -> tuple[int, int]:
        """``(start, end)`` of layer ``layer``'s buffer in the cache's ``plane``:
        ``decode_layer(cache.layers[i], plane0[slice(*cache.span(i, 0))])``."""
        start = self.offset(layer, plane)
        return start, start + self.layers[layer].plane_size(plane)

    def plane_size(self, plane: int) -> int:
        """Total bytes of the cache on ``plane``."""
        return max(
            (offs[plane] + layer.plane_size(plane) for layer, offs in zip(self.layers, self.offsets)
             if plane < len(offs)),
            default=0,
        )

    def validate(self) -> None:
        """Raise :class:`LayoutError` on a wrong version or misplaced/overlapping layers."""
        if self.version != FORMAT_VERSION:
            raise LayoutError(
                f"layout version {self.version!r} is not supported (this build reads version {FORMAT_VERSION})"
            )
        if not 1 <= len(self.layers) <= MAX_LAYERS:
            raise LayoutError(f"a cache needs 1..{MAX_LAYERS} layers, got {len(self.layers)}")
        if len(self.offsets) != len(self.layers):
            raise LayoutError(f"{len(self.offsets)} offset entries for {len(self.layers)} layers")
        spans: list[list[tuple[int, int, int]]] = [[] for _ in range(MAX_PLANES)]
        checked: set[int] = set()  # a layer object shared by several layers is checked once
        for i, (layer, offs) in enumerate(zip(self.layers, self.offsets)):
            if id(layer) not in checked:
                layer.validate()
                checked.add(id(layer))
            if len(offs) != layer.num_planes:
                raise LayoutError(f"layer {i} has buffers on {layer.num_planes} planes but {len(offs)} offsets")
            for plane, off in enumerate(offs):
                _int(off, f"layer {i} plane {plane} offset", 0, MAX_STREAM_BYTES)
                if off % ALIGN:
                    raise LayoutError(f"layer {i} plane {plane} offset {off} is not a multiple of {ALIGN}")
                spans[plane].append((off, off + layer.plane_size(plane), i))
        for plane, items in enumerate(spans):
            items.sort()
            for (a0, a1, ia), (b0, _b1, ib) in itertools.pairwise(items):
                if b0 < a1:
                    raise LayoutError(
                        f"layers {ia} and {ib} overlap on plane {plane} ([{a0}, {a1}) and offset {b0})"
                    )
            if items and items[-1][1] > MAX_STREAM_BYTES:
                raise LayoutError(
                    f"plane {plane} would be {items[-1][1]} bytes, more than the {MAX_STREAM_BYTES} allowed"
                )

    def to_bytes(self) -> bytes:
        # json.dumps's text for the whole object; each distinct layer described once
        compact = functools.partial(json.dumps, separators=(",", ":"))
        described: dict[int, str] = {}
        layers = []
        for layer, offs in zip(self.layers, self.offsets):
            if (text := described.get(id(layer))) is None:
                text = described[id(layer)] = compact(layer.to_json())[:-1]
            layers.append(f'{text},"offsets":{compact(list(offs))}}}')
        head = compact({"format": FORMAT_NAME, "version": self.version})[:-1]
        return f'{head},"layers":[{",".join(layers)}]}}'.encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = MAX_DESCRIPTOR_BYTES) -> CacheLayout:
        """Parse and validate a descriptor; :class:`LayoutError` on anything inconsistent."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise LayoutError(f"layout descriptor must be bytes, got {type(data).__name__}")
        if len(data) > max_bytes:
            raise LayoutError(f"layout descriptor is {len(data)} bytes, more than the {max_bytes} allowed")
        try:
            obj = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise LayoutError(f"layout descriptor is not valid JSON: {exc}") from None
        d = _fields(obj, "layout", ("format", "version", "layers"))
        if d["format"] != FORMAT_NAME:
            raise LayoutError(f"not a Lynx layout descriptor (format {d['format']!r})")
        version = d["version"]
        if isinstance(version, bool) or version != FORMAT_VERSION:
            raise LayoutError(
                f"layout version {version!r} is not supported (this build reads version {FORMAT_VERSION})"
            )
        if not isinstance(d["layers"], list) or not 1 <= len(d["layers"]) <= MAX_LAYERS:
            raise LayoutError(f"layout layers must be a list of 1..{MAX_LAYERS} layers")
        layers, offsets = [], []
        parsed: dict[str, LayerLayout] = {}  # a model's layers mostly repeat: each descriptor parsed once
        for i, item in enumerate(d["layers"]):
            if not isinstance(item, dict) or "offsets" not in item:
                raise LayoutError(f"layer {i} must be an object with offsets")
            item = dict(item)
            offs = item.pop("offsets")
            key = json.dumps(item, sort_keys=True, separators=(",", ":"))
            layer = parsed.get(key)
            if layer is None:
                try:
                    layer = parsed[key] = LayerLayout.from_json(item)
                except LayoutError as exc:
                    raise LayoutError(f"layer {i}: {exc}") from None
            if not isinstance(offs, list) or len(offs) > MAX_PLANES:
                raise LayoutError(f"layer {i} offsets must be a list of at most {MAX_PLANES} ints")
            layers.append(layer)
            offsets.append(tuple(offs))
        out = cls(tuple(layers), tuple(offsets), version)
        out.validate()
        return out
