"""The KV cache :class:`~lynx_decode.model.hf.HFCausalLM` runs on: a transformers
cache whose layers are views over preallocated slabs, and the torch thread
setting during a pass over a cache still arriving.

Each layer of a :class:`SlabCache` is a view over a preallocated float32 slab
``[1, kv_heads, capacity, head_dim]`` that shares memory with a
:class:`~lynx_decode.model.buffers.KVBuffers` (no copy on import). Appends write
past the received positions (never into them) and only reallocate when the
headroom is used up, unlike ``DynamicCache`` which copies the whole cache on
every step. Rollback (:meth:`SlabCache.crop`) just shortens the views.
Each layer is the cache type transformers itself gives it (``DynamicLayer`` for
full attention, ``DynamicSlidingWindowLayer`` for a sliding window, by
:func:`~lynx_decode.model.hf.model_geometry`); a sliding layer may hold only its
window's last positions (a received cache), its slab then starting at that
absolute position (the attention mask's offset), and a crop keeps the window.

:class:`ThreadGovernor`: a forward pass over a cache that is still arriving runs
on ``streaming_threads`` torch threads (default: one fewer than torch's setting,
at least one) while some layer is still missing, leaving a core to the threads
that receive and dequantize them, and on all of torch's threads once every
layer is in (checked before each layer); torch's setting is restored when the
pass returns.

torch and transformers are imported lazily, inside functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lynx_decode.errors import DecodeError
from lynx_decode.model.buffers import KVBuffers

if TYPE_CHECKING:
    import torch

__all__ = ["SlabCache", "ThreadGovernor", "GROWTH"]

GROWTH = 256          # minimum extra positions when a slab has to grow


class ThreadGovernor:
    """torch's (process-wide) intra-op threads during a forward pass over a cache
    still arriving: ``streaming`` threads (None: one fewer than torch's setting,
    at least one) while some layer is still missing - the spare core receives and
    dequantizes them -, all of torch's threads once every layer is in (only
    compute is left). torch's setting is restored at exit."""

    def __init__(self, streaming: int | None) -> None:
        self._streaming = streaming

    def __enter__(self) -> ThreadGovernor:
        import torch  # noqa: PLC0415

        self._set = torch.set_num_threads
        self.full = self.current = torch.get_num_threads()
        self.low = min(self.full, max(1, self.full - 1) if self._streaming is None
                       else self._streaming)
        return self

    def update(self, all_in: bool) -> None:
        want = self.full if all_in else self.low
        if want != self.current:
            self._set(want)
            self.current = want

    def __exit__(self, *exc: object) -> None:
        if self.current != self.full:
            self._set(self.full)


class SlabCache:
    """A transformers cache whose layers are views over preallocated slabs."""

    def __init__(self, kv: KVBuffers, *, length: int,
                 wait: Callable[[int], KVBuffers | None] | None = None,
                 windows: Sequence[int | None] | None = None) -> None:
        import torch  # noqa: PLC0415
        from transformers import DynamicCache  # noqa: PLC0415

        self.hf_cache = DynamicCache()
        self.governor: ThreadGovernor | None = None  # set by HFCausalLM.forward
        self._wait = wait
        self._kv = kv
        shape = kv.shape
        windows = list(windows) if windows is not None else [g.window for g in shape.geometry]
        # a layer keeping fewer positions than the cache covers holds the last ones
        self.hf_cache.layers = [
            _slab_layer(torch.from_numpy(kv.storage_keys[i])[None],
                        torch.from_numpy(kv.storage_values[i])[None], length,
                        None if wait is None else functools.partial(self._wait_layer, i),
                        offset=shape.tokens - shape.layer_tokens(i), window=windows[i])
            for i in range(shape.num_layers)]
        self._layers: list[Any] = self.hf_cache.layers  # the slab layers are built at run time: untyped

    @property
    def num_tokens(self) -> int:
        return self._layers[0].length

    def _wait_layer(self, index: int) -> None:
        assert self._wait is not None
        if self.governor is not None:
            self.governor.update(self._kv.complete)
        source = self._wait(index)
        if source is not None and source is not self._kv:  # this layer reads another level's K/V
            if not source.same_layout(self._kv):
                raise DecodeError(f"layer {index}: the buffers to read have another layout than the cache's")
            import torch  # noqa: PLC0415

            self._layers[index].rebind(torch.from_numpy(source.storage_keys[index])[None],
                                       torch.from_numpy(source.storage_values[index])[None])

    @property
    def filling(self) -> bool:
        """True while some layer has not been waited for yet (the cache may still
        be arriving; see ``HFCausalLM.cache_from``)."""
        return any(layer.lynx_wait is not None for layer in self._layers)

    @property
    def grew(self) -> bool:
        """True once an append outgrew the buffers' headroom (slabs were copied)."""
        return any(layer.grew for layer in self._layers)

    def crop(self, num_tokens: int) -> None:
        """Roll back to ``num_tokens`` positions (a sliding layer keeps its window:
        it can only lose positions appended after the received ones)."""
        floor = max(layer.offset for layer in self._layers)
        if not floor <= num_tokens <= self.num_tokens:
            raise DecodeError(f"cannot crop a cache of {self.num_tokens} positions "
                              f"to {num_tokens}" + (f" (its windows start at {floor})" if floor else ""))
        for layer in self._layers:
            layer.set_length(num_tokens)


def _slab_layer(keys: Any, values: Any, length: int, wait: Callable[[], None] | None, *,
                offset: int, window: int | None) -> Any:
    """The layer cache transformers itself would use for this layer, over the slabs:
    a ``DynamicLayer`` for full attention, a ``DynamicSlidingWindowLayer`` for a window."""
    full, sliding = _slab_layer_classes()
    if window is None:
        return full(keys, values, length, wait, offset=offset)
    return sliding(keys, values, length, wait, offset=offset, window=window)


class _Slab:
    """Slab index ``j`` holds absolute position ``offset + j``: ``offset`` is 0 for a
    layer holding every position, ``covered - kept`` for a sliding-window layer
    holding only its window's last positions (transformers' attention masks take
    the offset from :meth:`get_mask_sizes` and apply the window themselves).
    ``length`` is absolute. Appends never trim the window, so a rollback (a crop
    to any length from ``offset`` up) keeps every position a kept token can see."""

    keys: torch.Tensor | None
    values: torch.Tensor | None

    def _init_slab(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                   wait: Callable[[], None] | None, offset: int) -> None:
        self.lynx_wait = wait  # called once, when attention first needs this layer's cache
        self.k_slab, self.v_slab = keys, values
        self.device = keys.device
        self.is_initialized = True
        self.grew = False
        self.offset = offset
        self.set_length(length)

    def rebind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Read (and append to) other slabs of the same shape from now on."""
        self.k_slab, self.v_slab = keys, values
        self.set_length(self.length)

    def set_length(self, length: int) -> None:
        self.length = self.cumulative_length = length
        self.keys = self.k_slab[:, :, :length - self.offset]
        self.values = self.v_slab[:, :, :length - self.offset]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length - self.offset + query_length, self.offset

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lynx_wait is not None:
            wait, self.lynx_wait = self.lynx_wait, None
            wait()
        start = self.length - self.offset
        end = start + key_states.shape[-2]
        if end > self.k_slab.shape[-2]:
            self._grow(end + max(GROWTH, end // 8))
        self.k_slab[:, :, start:end] = key_states
        self.v_slab[:, :, start:end] = value_states
        self.set_length(self.offset + end)
        assert self.keys is not None and self.values is not None  # set by set_length
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        import torch  # noqa: PLC0415

        b, h, _, d = self.k_slab.shape
        keys = torch.empty((b, h, capacity, d), dtype=self.k_slab.dtype)
        values = torch.empty((b, h, capacity, d), dtype=self.v_slab.dtype)
        assert self.keys is not None and self.values is not None  # set by set_length
        kept = self.length - self.offset
        keys[:, :, :kept] = self.keys
        values[:, :, :kept] = self.values
        self.k_slab, self.v_slab, self.grew = keys, values, True

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self.set_length(max(self.offset, self.length + tokens_to_remove))


@functools.cache
def _slab_layer_classes() -> tuple[type, type]:
    """Built on first use so that transformers is imported lazily."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: PLC0415

    class _SlabLayer(_Slab, DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                     wait: Callable[[], None] | None = None, *, offset: int = 0) -> None:
            DynamicLayer.__init__(self)
            self._init_slab(keys, values, length, wait, offset)

    class _SlidingSlabLayer(_Slab, DynamicSlidingWindowLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                     wait: Callable[[], None] | None = None, *, offset: int = 0,
                     window: int) -> None:
            DynamicSlidingWindowLayer.__init__(self, sliding_window=window)
            self._init_slab(keys, values, length, wait, offset)

    return _SlabLayer, _SlidingSlabLayer
