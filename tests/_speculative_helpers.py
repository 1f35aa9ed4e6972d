"""Helpers shared by the engine's unit tests (toy model) and its real-model tests."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence

import numpy as np

from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.model import KVBuffers, ModelInfo, Prefill


class LandsWhenAwaited(cf.Future):  # type: ignore[type-arg]
    """A full-cache future whose residual "lands" at the latest when the engine
    blocks on it (after drafting stopped for another reason: max_draft, EOS)."""

    def __init__(self, kv: KVBuffers) -> None:
        super().__init__()
        self.kv = kv

    def result(self, timeout: float | None = None) -> KVBuffers:
        if not self.done():
            self.set_result(self.kv)
        return super().result(timeout)


VOCAB = 40
EOS = 0
STEP_S = 0.07


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ToyCache:
    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.pending: tuple[KVBuffers, Callable[[int], None] | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.values)

    def crop(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self.values):
            raise DecodeError("bad crop")
        del self.values[num_tokens:]


class ToyLM:
    """Next token = bucket of the sum of everything cached (K values). A draft
    cache offset by ``delta`` agrees with the full cache while both sums fall
    in the same bucket, so acceptance varies with the prompt and the offset."""

    def __init__(self, eos: bool = True, max_positions: int = 4096,
                 clock: Clock | None = None) -> None:
        self.info = ModelInfo("toy", 1, 1, 1, max_positions, VOCAB,
                              frozenset({EOS}) if eos else frozenset())
        self.clock = clock
        self.calls: list[int] = []

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        if len(token_ids) > self.info.max_positions:  # as the protocol (and HFCausalLM) says
            raise PromptError(f"the prompt has {len(token_ids)} tokens; the model's context "
                              f"window is {self.info.max_positions}")
        kv = KVBuffers.from_layers([np.asarray(token_ids[:-1], np.float32).reshape(1, -1, 1)],
                                   [np.zeros((1, len(token_ids) - 1, 1), np.float32)])
        return Prefill(tuple(token_ids), kv, 0.0)

    def cache_from(self, kv: KVBuffers, *, wait: Callable[[int], None] | None = None) -> ToyCache:
        if wait is None and not kv.complete:
            raise DecodeError("incomplete")
        cache = ToyCache([])
        cache.pending = (kv, wait)
        return cache

    def forward(self, cache: ToyCache, token_ids: Sequence[int]) -> np.ndarray:
        if cache.pending is not None:  # the one layer's cache is first used here
            (kv, wait), cache.pending = cache.pending, None
            if wait is not None:
                wait(0)
            cache.values = [float(x) for x in kv.keys[0, 0, :, 0]]
        self.calls.append(len(token_ids))
        if self.clock is not None:
            self.clock.now += STEP_S
        rows = []
        for t in token_ids:
            cache.values.append(float(t))
            nxt = int(sum(cache.values) // 50) % VOCAB
            row = np.zeros(VOCAB, np.float32)
            row[nxt] = 1.0
            rows.append(row)
        return np.stack(rows)
