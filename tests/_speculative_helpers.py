"""Helpers shared by the engine's unit tests (toy model) and its real-model tests."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.events import Done, Event, Rollback, Tentative
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


class Landing(KVBuffers):
    """A level's buffers, landing layer by layer from ``source`` (written by :meth:`land`,
    or when the engine waits for a layer); the future resolves once all have."""

    def __init__(self, source: KVBuffers, future: cf.Future[KVBuffers]) -> None:
        super().__init__(source.shape, headroom=source.headroom)
        self.source, self.future = source, future

    def land(self, index: int) -> None:
        if not self.written(index):
            self.write_layer(index, *self.source.layer(index))
            if self.complete and not self.future.done():
                self.future.set_result(self)

    def land_all(self) -> None:
        for i in range(self.shape.num_layers):
            self.land(i)

    def wait_layer(self, index: int, timeout: float) -> None:
        self.land(index)  # the engine blocks on it: it lands now (a virtual clock of events)
        super().wait_layer(index, timeout)


class LandsWith(Landing):
    """A level (the anchors) whose layer, once the engine has waited for it, brings the same
    layer of ``other`` (the residual lands as the pass reaches each layer)."""

    def __init__(self, source: KVBuffers, future: cf.Future[KVBuffers], other: Landing) -> None:
        super().__init__(source, future)
        self.other = other

    def wait_layer(self, index: int, timeout: float) -> None:
        super().wait_layer(index, timeout)
        self.other.land(index)


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
        self.pending: tuple[KVBuffers, Callable[[int], KVBuffers | None] | None] | None = None

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

    def cache_from(self, kv: KVBuffers, *, wait: Callable[[int], KVBuffers | None] | None = None) -> ToyCache:
        if wait is None and not kv.complete:
            raise DecodeError("incomplete")
        cache = ToyCache([])
        cache.pending = (kv, wait)
        return cache

    def forward(self, cache: ToyCache, token_ids: Sequence[int]) -> np.ndarray:
        if cache.pending is not None:  # the one layer's cache is first used here
            (kv, wait), cache.pending = cache.pending, None
            if wait is not None:
                kv = wait(0) or kv  # the buffers the layer reads: the finest level landed
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


def check_events(events: list[Event], expected: list[int]) -> None:
    """The event protocol, replayed as an embedder would."""
    shown: list[int] = []
    committed: list[int] = []
    assert isinstance(events[-1], Done)
    for event in events[:-1]:
        assert not isinstance(event, Done)
        if isinstance(event, Tentative):
            assert not committed, "tentative tokens only before the first commit"
            assert event.position == len(shown)
            shown.append(event.token)
        elif isinstance(event, Rollback):
            assert event.from_position + event.n_rejected == len(shown)
            assert event.n_rejected > 0
            shown = shown[: event.from_position]
        else:
            assert event.position == len(committed)
            committed.extend(event.tokens)
            # committed tokens confirm what was shown, then extend it
            assert committed[: len(shown)] == shown[: len(committed)]
    assert committed == expected
    assert list(events[-1].tokens) == expected


def greedy_reference(model: Any, ids: list[int], kv: KVBuffers, n: int) -> list[int]:
    """Plain greedy decoding on ``kv``, one token a step (a toy model's)."""
    cache = model.cache_from(kv)
    out: list[int] = []
    x = ids[-1]
    while len(out) < n:
        x = int(np.argmax(model.forward(cache, [x])[-1]))
        out.append(x)
        if x in model.info.eos_token_ids:
            break
    return out
