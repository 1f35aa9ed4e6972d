"""The producer's end: prefills vLLM computed, held in their native precision
until a consumer pulls them, and served by a Lynx :class:`~lynx_decode.PrefillNode`.

vLLM's worker hands each request's K/V to :meth:`HeldPrefills.save_layer` layer
by layer as its last prefill step runs (copied out of the paged blocks, so vLLM
can free them at once), and :meth:`HeldPrefills.finish` publishes the prefill.
A consumer's pull request (a :class:`~lynx_decode.request.KVRequest` carrying
the prompt's token ids and the scheme it wants) reaches the prefill node, which
asks :meth:`HeldPrefills.prefill` for those ids and encodes and streams the cache
the usual Lynx way: anchors first, layer by layer, through the node's one
egress (one send scheduler and one link rate for every consumer, so a new
request's anchors go before older residuals).

The clock a consumer's ``t0`` starts on is the prefill node's: the moment the
cache is held (here: pulled from the store), as in every Lynx run.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lynx_decode.errors import DecodeError
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import LMCache, ModelInfo, Prefill

__all__ = ["HeldPrefills"]


class _Saving:
    def __init__(self, ids: tuple[int, ...], kv: KVBuffers, started: float) -> None:
        self.ids = ids
        self.kv = kv
        self.started = started
        self.done = threading.Event()
        self.prefill: Prefill | None = None


class HeldPrefills:
    """The producer's held prefills, keyed by prompt token ids; a
    :class:`~lynx_decode.model.protocol.CausalLM` for :class:`~lynx_decode.PrefillNode` whose
    ``prefill`` finds the cache vLLM computed (it never runs a model itself).

    ``max_prefills``: prefills held (the oldest published one is dropped first).
    ``wait_s``: how long a pull for a prefill still being saved waits for it.
    """

    def __init__(self, info: ModelInfo, *, max_prefills: int = 16, wait_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._info = info
        self._max = max_prefills
        self._wait_s = wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[tuple[int, ...], Prefill] = collections.OrderedDict()
        self._saving: dict[tuple[int, ...], _Saving] = {}

    @property
    def info(self) -> ModelInfo:
        return self._info

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    # -- the worker's side (vLLM's save_kv_layer / wait_for_save) ---------------------------------
    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start saving the cache of ``prompt_ids[:-1]`` (every layer must follow, then :meth:`finish`)."""
        ids = tuple(int(t) for t in prompt_ids)
        if len(ids) < 2:
            raise DecodeError(f"a prompt of {len(ids)} token(s) has no cache to hold")
        info = self._info
        kv = KVBuffers(KVShape(info.num_layers, info.kv_heads, len(ids) - 1, info.head_dim))
        with self._lock:
            self._saving[ids] = _Saving(ids, kv, self._clock())

    def save_layer(self, prompt_ids: Sequence[int], layer: int, k: Any, v: Any) -> None:
        """Layer ``layer``'s K and V (``[kv_heads, len(prompt_ids) - 1, head_dim]``, any float dtype)."""
        saving = self._saving_of(prompt_ids)
        saving.kv.write_layer(layer, np.asarray(k, dtype=np.float32), np.asarray(v, dtype=np.float32))

    def finish(self, prompt_ids: Sequence[int]) -> Prefill:
        """Publish the saved prefill (every layer written): pulls for it are served from now on."""
        ids = tuple(int(t) for t in prompt_ids)
        with self._lock:
            saving = self._saving.pop(ids, None)
        if saving is None:
            raise DecodeError("finish() without begin() for this prompt")
        missing = saving.kv.missing_layers()
        if missing:
            saving.done.set()
            raise DecodeError(f"the prefill of {len(ids)} tokens is missing layers {missing}")
        prefill = Prefill(ids, saving.kv, self._clock() - saving.started)
        with self._lock:
            self._held[ids] = prefill
            self._held.move_to_end(ids)
            while len(self._held) > self._max:
                self._held.popitem(last=False)
        saving.prefill = prefill
        saving.done.set()
        return prefill

    def abort(self, prompt_ids: Sequence[int]) -> None:
        """Forget a save that will not finish (the request was preempted or aborted)."""
        with self._lock:
            saving = self._saving.pop(tuple(int(t) for t in prompt_ids), None)
        if saving is not None:
            saving.done.set()

    def _saving_of(self, prompt_ids: Sequence[int]) -> _Saving:
        with self._lock:
            saving = self._saving.get(tuple(int(t) for t in prompt_ids))
        if saving is None:
            raise DecodeError("save_layer() without begin() for this prompt")
        return saving

    # -- the prefill node's side ---------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        """The held prefill of ``token_ids`` (waiting up to ``wait_s`` for one still being saved), or
        :class:`DecodeError` saying it is not held."""
        ids = tuple(int(t) for t in token_ids)
        with self._lock:
            held = self._held.get(ids)
            if held is not None:
                self._held.move_to_end(ids)
                return held
            saving = self._saving.get(ids)
        if saving is not None and saving.done.wait(self._wait_s) and saving.prefill is not None:
            return saving.prefill
        raise DecodeError(f"this producer holds no prefill of the {len(ids)}-token prompt: it was not "
                          f"prefilled here, or was dropped (it holds the last {self._max})")

    def tokenize(self, text: str) -> list[int]:
        raise DecodeError("the vLLM producer serves token-id prompts only")

    def chat_prompt(self, message: str) -> list[int]:
        raise DecodeError("the vLLM producer serves token-id prompts only")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        raise DecodeError("the vLLM producer has no tokenizer")

    def cache_from(self, kv: KVBuffers, *, wait: Callable[[int], None] | None = None) -> LMCache:
        raise DecodeError("the vLLM producer does not decode")

    def forward(self, cache: LMCache, token_ids: Sequence[int]) -> np.ndarray:
        raise DecodeError("the vLLM producer does not decode")
