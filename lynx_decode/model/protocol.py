"""What the decode engine needs from a model: a causal LM whose KV cache can be
exported and imported per layer.

Cache convention (used everywhere in Lynx): for a prompt ``ids`` the prefill
node's cache covers ``ids[:-1]``; the last prompt token travels with the stream
and the decode node runs it against the received cache to get the first logits.
So ``prefill(ids)`` returns ``len(ids) - 1`` cached positions, and a decode
starts with ``forward(cache, [ids[-1]])``.

All logits are float32 and computed in float32 (exactness of speculative
verification depends on it; see docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.geometry import LayerGeometry, uniform
from lynx_decode.model.identity import ModelFingerprint

__all__ = ["ModelInfo", "Prefill", "LMCache", "CausalLM"]


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a model. ``model_id`` names the exact weights and is
    safe to use in cache keys (it changes when the weights change).

    ``layers``: each layer's cache geometry (heads, head size, sliding window);
    empty means ``num_layers`` full-attention layers of ``kv_heads`` x
    ``head_dim`` (filled in). ``kv_heads``/``head_dim`` are layer 0's.
    ``fingerprint``: what a cache must have been computed with to be valid for
    this model (:mod:`lynx_decode.model.identity`; None: unknown, then streams
    are matched by ``model_id``)."""

    model_id: str
    num_layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    layers: tuple[LayerGeometry, ...] = ()
    fingerprint: ModelFingerprint | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", uniform(self.num_layers, self.kv_heads, self.head_dim))
        elif (len(self.layers), self.layers[0].kv_heads, self.layers[0].head_dim) != (
                self.num_layers, self.kv_heads, self.head_dim):
            raise ValueError("ModelInfo: num_layers, kv_heads and head_dim must agree with layers")

    @property
    def sliding(self) -> bool:
        """True when some layer attends through a sliding window."""
        return any(g.sliding for g in self.layers)

    def kv_shape(self, tokens: int, *, windowed: bool = True) -> KVShape:
        """The cache of ``tokens`` positions: what a decode node receives (each
        sliding layer its window's last positions) or, without ``windowed``, what a
        prefill holds (every layer all of them)."""
        return KVShape.of(self.layers, tokens, windowed=windowed)


@dataclass(frozen=True)
class Prefill:
    """Result of a prefill: the cache of ``token_ids[:-1]`` in float32."""

    token_ids: tuple[int, ...]
    kv: KVBuffers
    prefill_s: float

    @property
    def cached_tokens(self) -> int:
        return self.kv.shape.tokens


@runtime_checkable
class LMCache(Protocol):
    """A model-side KV cache that :meth:`CausalLM.forward` appends to."""

    @property
    def num_tokens(self) -> int:
        """Number of cached positions."""
        ...

    def crop(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` positions (rolls back rejected drafts).

        Raises DecodeError if ``num_tokens`` is negative or above :attr:`num_tokens`."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM with per-layer KV export/import. Implementations: :class:`HFCausalLM`."""

    @property
    def info(self) -> ModelInfo: ...

    def tokenize(self, text: str) -> list[int]:
        """Plain text to token ids (the tokenizer's default special tokens)."""
        ...

    def chat_prompt(self, message: str) -> list[int]:
        """One user message in the model's chat template, ready for generation."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str: ...

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        """Cache of ``token_ids[:-1]``. Raises PromptError for fewer than 2 tokens,
        more than ``info.max_positions`` tokens, or ids outside the vocabulary."""
        ...

    def cache_from(self, kv: KVBuffers, *,
                   wait: Callable[[int], KVBuffers | None] | None = None) -> LMCache:
        """A model cache over ``kv`` (no copy; the received positions are never
        written). Raises DecodeError if the shape does not match the model, or,
        without ``wait``, if a layer is missing. With ``wait``, ``kv`` may still be
        filling: ``wait(i)`` is called (once) before layer ``i``'s cache is first
        used, so a forward pass can start while later layers are still arriving.
        It returns the buffers layer ``i`` reads from then on: ``None`` for ``kv``'s
        own, or other buffers of the same layout (:meth:`KVBuffers.same_layout`:
        another level of the same stream, whose layer ``i`` is finer)."""
        ...

    def forward(self, cache: LMCache, token_ids: Sequence[int]) -> np.ndarray:
        """Run ``token_ids`` after the cached positions, append them to ``cache``
        and return float32 logits ``[len(token_ids), vocab_size]`` (one pass)."""
        ...
