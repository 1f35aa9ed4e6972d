"""Per-layer cache geometry: what one layer of a model keeps in its KV cache.

A model's layers need not agree. Each :class:`LayerGeometry` says how many K/V
heads the layer has, its head size, the dtype its cache is rebuilt in, and its
attention *window*: ``None`` for full attention (the layer keeps every
position), or ``W`` for sliding-window attention, where the query at position
``p`` attends to positions ``p - W + 1 .. p`` (transformers' convention,
``masking_utils.sliding_window_overlay``). A sliding layer therefore needs only
the last ``W - 1`` cached positions to decode the next token, and that is all
Lynx sends of it (:meth:`LayerGeometry.kept`).

Rolling back rejected drafts inside a window needs nothing more: the decode
node's cache keeps the received window plus every position appended since, and
a crop only shortens it (``lynx_decode.model.slab``), so every position a kept
token can still attend to is there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lynx_decode.errors import DecodeError, LayoutError

__all__ = ["LayerGeometry", "CACHE_DTYPE", "uniform", "geometry_json", "geometry_from_json"]

#: The dtype every cache is rebuilt in on the decode node (exactness needs fp32; docs/design.md).
CACHE_DTYPE = "float32"
_MAX = 1 << 20


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's cache: ``kv_heads`` heads of ``head_dim`` values per position,
    ``window`` (None: full attention; ``W``: a sliding window of ``W`` positions,
    the query's own included) and the ``dtype`` the cache is held in."""

    kv_heads: int
    head_dim: int
    window: int | None = None
    dtype: str = CACHE_DTYPE

    def __post_init__(self) -> None:
        for name in ("kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX:
                raise DecodeError(f"LayerGeometry.{name} must be an int in 1..{_MAX}, got {value!r}")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= (1 << 30)):
            raise DecodeError(f"LayerGeometry.window must be None or an int >= 2, got {w!r}")
        if self.dtype != CACHE_DTYPE:
            raise DecodeError(f"LayerGeometry.dtype must be {CACHE_DTYPE!r}, got {self.dtype!r}")

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def kept(self, cached: int) -> int:
        """Positions of a cache covering ``cached`` positions that this layer still
        needs: all of them for full attention, the last ``W - 1`` in a window."""
        return cached if self.window is None else min(cached, self.window - 1)

    def to_json(self) -> dict[str, Any]:
        return {"kv_heads": self.kv_heads, "head_dim": self.head_dim, "window": self.window,
                "dtype": self.dtype}

    @classmethod
    def from_json(cls, obj: Any) -> LayerGeometry:
        """Parse one layer's geometry; :class:`LayoutError` when malformed."""
        if not isinstance(obj, dict) or set(obj) != {"kv_heads", "head_dim", "window", "dtype"}:
            raise LayoutError(f"a layer's geometry must have kv_heads, head_dim, window and dtype, got {obj!r}")
        try:
            return cls(obj["kv_heads"], obj["head_dim"], obj["window"], obj["dtype"])
        except DecodeError as exc:
            raise LayoutError(str(exc)) from None

    def describe(self) -> str:
        attention = "full" if self.window is None else f"window {self.window}"
        return f"{self.kv_heads} kv heads x {self.head_dim}, {attention}"


def uniform(num_layers: int, kv_heads: int, head_dim: int) -> tuple[LayerGeometry, ...]:
    """``num_layers`` full-attention layers of one shape."""
    return tuple(LayerGeometry(kv_heads, head_dim) for _ in range(num_layers))


def geometry_json(layers: Sequence[LayerGeometry]) -> list[dict[str, Any]]:
    return [g.to_json() for g in layers]


def geometry_from_json(obj: Any, limit: int = 4096) -> tuple[LayerGeometry, ...]:
    if not isinstance(obj, list) or not 1 <= len(obj) <= limit:
        raise LayoutError(f"the geometry must be a list of 1..{limit} layers")
    return tuple(LayerGeometry.from_json(item) for item in obj)
