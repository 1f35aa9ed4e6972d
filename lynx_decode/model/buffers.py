"""Per-layer K/V buffers: the hand-off between the codec and the model.

A :class:`KVBuffers` owns float32 K (after RoPE) and V for every layer: two arrays
``[layers, kv_heads, tokens, head_dim]`` when every layer has one shape, else one
``[kv_heads, kept, head_dim]`` pair per layer (a :class:`KVShape` built from
per-layer :class:`~lynx_decode.model.geometry.LayerGeometry` with ``windowed``:
a sliding-window layer keeps only the last positions its window can still
attend to, ``kept = min(tokens, window - 1)``, the *last* ones of the ``tokens``
positions the cache covers). The decode node allocates one per cache it will
receive (the anchor-only *draft* cache, the exact *full* cache) and writes each
layer in place as it lands (:meth:`KVBuffers.write_layer`, or
:meth:`KVBuffers.layer` for a zero-copy view a kernel can fill). A model cache is
built from the buffers only once every layer has been written; building it does
not copy and decoding never writes back into the buffers.

Thread model: one writer (the transport callback thread) fills layers, then hands
the buffers to the decode thread through a ``concurrent.futures.Future``; the
future provides the happens-before edge. The buffers themselves are not locked.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lynx_decode.errors import DecodeError
from lynx_decode.model.geometry import LayerGeometry, uniform

__all__ = ["KVShape", "KVBuffers"]


@dataclass(frozen=True)
class KVShape:
    """Shape of one model's KV cache covering ``tokens`` positions.

    ``layers`` (optional): each layer's geometry (heads, head size, window);
    empty means ``num_layers`` full layers of ``kv_heads`` x ``head_dim``. With
    ``windowed``, a sliding-window layer keeps only ``geometry.kept(tokens)``
    positions, the last ones (a received cache); without, every layer keeps all
    ``tokens`` (a prefill). Build per-layer shapes with :meth:`of`."""

    num_layers: int
    kv_heads: int
    tokens: int
    head_dim: int
    layers: tuple[LayerGeometry, ...] = ()
    windowed: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise DecodeError(f"KVShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens < 0:
            raise DecodeError(f"KVShape.tokens must be >= 0, got {self.tokens}")
        if self.layers:
            if len(self.layers) != self.num_layers:
                raise DecodeError(f"KVShape has {self.num_layers} layers but {len(self.layers)} geometries")
            if (self.layers[0].kv_heads, self.layers[0].head_dim) != (self.kv_heads, self.head_dim):
                raise DecodeError("KVShape.kv_heads/head_dim must be layer 0's")

    @classmethod
    def of(cls, layers: tuple[LayerGeometry, ...], tokens: int, *, windowed: bool = True) -> KVShape:
        """The shape of a cache of ``tokens`` positions for a model with these layers."""
        if not layers:
            raise DecodeError("a KV shape needs at least one layer")
        first = layers[0]
        same = all((g.kv_heads, g.head_dim) == (first.kv_heads, first.head_dim) for g in layers)
        if same and (not windowed or not any(g.sliding for g in layers)):
            return cls(len(layers), first.kv_heads, tokens, first.head_dim)  # the plain, uniform shape
        return cls(len(layers), first.kv_heads, tokens, first.head_dim, tuple(layers), windowed)

    @property
    def geometry(self) -> tuple[LayerGeometry, ...]:
        """Every layer's geometry (full layers of one shape when none was given)."""
        return self.layers or uniform(self.num_layers, self.kv_heads, self.head_dim)

    def layer_tokens(self, index: int) -> int:
        """Positions layer ``index`` keeps: the last ones of the ``tokens`` covered."""
        if not self.layers or not self.windowed:
            return self.tokens
        return self.layers[index].kept(self.tokens)

    def shape_of(self, index: int) -> tuple[int, int, int]:
        """``(kv_heads, kept, head_dim)`` of layer ``index``'s K (or V)."""
        if not self.layers:
            return (self.kv_heads, self.tokens, self.head_dim)
        g = self.layers[index]
        return (g.kv_heads, self.layer_tokens(index), g.head_dim)

    @property
    def uniform(self) -> bool:
        """True when every layer has the same ``(kv_heads, kept, head_dim)``."""
        return not self.layers or len({self.shape_of(i) for i in range(self.num_layers)}) == 1

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """``(kv_heads, tokens, head_dim)``: the shape of one layer's K (or V), when
        all layers share it (:meth:`shape_of` gives any layer's)."""
        if not self.uniform:
            raise DecodeError("the layers of this cache differ in shape; use shape_of(layer)")
        return self.shape_of(0)

    @property
    def values_per_token(self) -> int:
        """K and V values of all layers for one token (11,520 for SmolLM2-135M)."""
        return 2 * sum(g.kv_heads * g.head_dim for g in self.geometry)

    @property
    def stored_values(self) -> int:
        """K and V values held for the whole cache (every layer's kept positions)."""
        return 2 * sum(h * t * d for h, t, d in (self.shape_of(i) for i in range(self.num_layers)))


class KVBuffers:
    """Preallocated float32 K and V for every layer, filled layer by layer.

    ``keys``/``values`` are ``[layers, kv_heads, tokens, head_dim]`` views (only
    when every layer has one shape; :meth:`layer` serves any layer). With
    ``headroom > 0`` the underlying storage holds that many extra positions per
    layer, so a model cache built over the buffers can append generated tokens
    without copying (the received positions are never overwritten); the views
    are then not C-contiguous across heads, each head's ``[tokens, head_dim]``
    block still is.
    """

    __slots__ = (
        "_cond",
        "_error",
        "_written",
        "headroom",
        "shape",
        "storage_keys",
        "storage_values",
    )

    def __init__(self, shape: KVShape, *, headroom: int = 0) -> None:
        if headroom < 0:
            raise DecodeError(f"headroom must be >= 0, got {headroom}")
        self.shape = shape
        self.headroom = headroom
        self.storage_keys: Any
        self.storage_values: Any
        if shape.uniform:
            heads, tokens, dim = shape.shape_of(0)
            storage = (shape.num_layers, heads, tokens + headroom, dim)
            self.storage_keys = np.zeros(storage, np.float32)
            self.storage_values = np.zeros(storage, np.float32)
        else:  # one array per layer: ``storage_keys[i]`` is layer i's either way
            sizes = [shape.shape_of(i) for i in range(shape.num_layers)]
            self.storage_keys = [np.zeros((h, t + headroom, d), np.float32) for h, t, d in sizes]
            self.storage_values = [np.zeros((h, t + headroom, d), np.float32) for h, t, d in sizes]
        self._written = np.zeros(shape.num_layers, dtype=bool)
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    @classmethod
    def from_layers(cls, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], *,
                    headroom: int = 0) -> KVBuffers:
        """Copy per-layer ``[kv_heads, tokens, head_dim]`` arrays into new buffers."""
        if len(keys) != len(values) or not keys:
            raise DecodeError(f"need the same non-zero number of K and V layers, "
                              f"got {len(keys)} and {len(values)}")
        if np.ndim(keys[0]) != 3:
            raise DecodeError(f"a layer's K must be [kv_heads, tokens, head_dim], "
                              f"got shape {np.shape(keys[0])}")
        heads, tokens, dim = np.shape(keys[0])
        buffers = cls(KVShape(len(keys), heads, tokens, dim), headroom=headroom)
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            buffers.write_layer(i, k, v)
        return buffers

    @property
    def keys(self) -> np.ndarray:
        """``[layers, kv_heads, tokens, head_dim]`` view of K (after RoPE)."""
        return self._whole(self.storage_keys)

    @property
    def values(self) -> np.ndarray:
        return self._whole(self.storage_values)

    def _whole(self, storage: Any) -> np.ndarray:
        if not isinstance(storage, np.ndarray):
            raise DecodeError("the layers of this cache differ in shape: read them one by one with layer(i)")
        return storage[:, :, : self.shape.layer_tokens(0)]

    def layer(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Writable views ``(K, V)`` of layer ``index`` (``shape.shape_of(index)``);
        call :meth:`mark_written` after."""
        self._check_index(index)
        t = self.shape.layer_tokens(index)
        return self.storage_keys[index][:, :t], self.storage_values[index][:, :t]

    def write_layer(self, index: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Copy one layer's K and V (any real dtype, cast to float32) and mark it written."""
        k_dst, v_dst = self.layer(index)
        want = self.shape.shape_of(index)
        for name, arr in (("keys", keys), ("values", values)):
            if tuple(np.shape(arr)) != want:
                raise DecodeError(f"layer {index} {name} has shape {tuple(np.shape(arr))}, "
                                  f"the model expects {want}")
        try:
            np.copyto(k_dst, keys, casting="same_kind")
            np.copyto(v_dst, values, casting="same_kind")
        except TypeError as exc:
            raise DecodeError(f"layer {index}: cannot store K/V as float32: {exc}") from exc
        self.mark_written(index)

    def prefault(self) -> KVBuffers:
        """Touch every page of the storage now and return ``self``.

        ``np.zeros`` maps pages lazily and the first write to each costs a page
        fault, so a caller that prepares buffers ahead of time keeps that cost
        off the clock."""
        for storage in (self.storage_keys, self.storage_values):
            for block in ([storage] if isinstance(storage, np.ndarray) else storage):
                block.fill(0.0)
        return self

    def reset(self) -> None:
        """Mark every layer unwritten, to fill the same buffers again (no reallocation)."""
        with self._cond:
            self._written[:] = False
            self._error = None

    def mark_written(self, index: int) -> None:
        """Record that layer ``index`` was filled in place through :meth:`layer`."""
        self._check_index(index)
        with self._cond:
            self._written[index] = True
            self._cond.notify_all()

    def abort(self, error: BaseException) -> None:
        """The missing layers will never come: wake :meth:`wait_layer` with ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_layer(self, index: int, timeout: float) -> None:
        """Block until layer ``index`` is written (at most ``timeout`` s). Raises
        DecodeError on timeout or after :meth:`abort` (chained to its error)."""
        self._check_index(index)
        with self._cond:
            if not self._cond.wait_for(lambda: self._written[index] or self._error is not None,
                                       timeout):
                raise DecodeError(f"KV layer {index} did not arrive within {timeout} s")
            if not self._written[index]:
                raise DecodeError(f"KV layer {index} will not arrive: {self._error}") from self._error

    def written(self, index: int) -> bool:
        """True once layer ``index`` has been written (never blocks)."""
        self._check_index(index)
        return bool(self._written[index])

    def same_layout(self, other: KVBuffers) -> bool:
        """True when ``other`` holds the same positions per layer in storage of the same
        capacity, so a cache can read one layer from either."""
        return self.shape == other.shape and self.headroom == other.headroom

    @property
    def complete(self) -> bool:
        """True once every layer has been written."""
        return bool(self._written.all())

    def missing_layers(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self._written)]

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.shape.num_layers:
            raise DecodeError(f"layer index {index} out of range [0, {self.shape.num_layers})")


