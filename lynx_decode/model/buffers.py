"""Per-layer K/V buffers: the hand-off between the codec and the model.

A :class:`KVBuffers` owns two float32 arrays ``[layers, kv_heads, tokens,
head_dim]`` (K after RoPE). The decode node allocates one per cache it will
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

import numpy as np

from lynx_decode.errors import DecodeError

__all__ = ["KVShape", "KVBuffers"]


@dataclass(frozen=True)
class KVShape:
    """Shape of one model's KV cache for ``tokens`` cached positions."""

    num_layers: int
    kv_heads: int
    tokens: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise DecodeError(f"KVShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens < 0:
            raise DecodeError(f"KVShape.tokens must be >= 0, got {self.tokens}")

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """``(kv_heads, tokens, head_dim)``: the shape of one layer's K (or V)."""
        return (self.kv_heads, self.tokens, self.head_dim)

    @property
    def values_per_token(self) -> int:
        """K and V values of all layers for one token (11,520 for SmolLM2-135M)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim


class KVBuffers:
    """Preallocated float32 K and V for every layer, filled layer by layer.

    ``keys``/``values`` are ``[layers, kv_heads, tokens, head_dim]`` views. With
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
        storage = (shape.num_layers, shape.kv_heads, shape.tokens + headroom, shape.head_dim)
        self.shape = shape
        self.headroom = headroom
        self.storage_keys = np.zeros(storage, np.float32)
        self.storage_values = np.zeros(storage, np.float32)
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
        return self.storage_keys[:, :, : self.shape.tokens]

    @property
    def values(self) -> np.ndarray:
        return self.storage_values[:, :, : self.shape.tokens]

    def layer(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Writable views ``(K, V)`` of layer ``index``; call :meth:`mark_written` after."""
        self._check_index(index)
        t = self.shape.tokens
        return self.storage_keys[index, :, :t], self.storage_values[index, :, :t]

    def write_layer(self, index: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Copy one layer's K and V (any real dtype, cast to float32) and mark it written."""
        k_dst, v_dst = self.layer(index)
        for name, arr in (("keys", keys), ("values", values)):
            if tuple(np.shape(arr)) != self.shape.layer_shape:
                raise DecodeError(f"layer {index} {name} has shape {tuple(np.shape(arr))}, "
                                  f"the model expects {self.shape.layer_shape}")
        try:
            np.copyto(k_dst, keys, casting="same_kind")
            np.copyto(v_dst, values, casting="same_kind")
        except TypeError as exc:
            raise DecodeError(f"layer {index}: cannot store K/V as float32: {exc}") from exc
        self.mark_written(index)

    def prefault(self) -> KVBuffers:
        """Touch every page of the storage now (``np.zeros`` maps pages lazily, and the
        first write to each costs a page fault: ~20 ms per 3 MB layer on a VM), so a
        caller that prepares buffers ahead of time keeps that cost off the clock."""
        self.storage_keys.fill(0.0)
        self.storage_values.fill(0.0)
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

    @property
    def complete(self) -> bool:
        """True once every layer has been written."""
        return bool(self._written.all())

    def missing_layers(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self._written)]

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.shape.num_layers:
            raise DecodeError(f"layer index {index} out of range [0, {self.shape.num_layers})")


