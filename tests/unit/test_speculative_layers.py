"""Each layer on the finest level that has landed: a pass reaching layer ``i`` reads the
finest level whose layer ``i`` is in at that moment; a first pass that read exact K/V in
every layer is final at once (no verify pass), as INT8's first token is; otherwise the
tokens stay tentative and are verified as before, the verify pass choosing per layer too.

A toy model of several layers (its next token depends on every layer's cache, so a
coarse layer can change it) and levels that land layer by layer on a schedule the test
drives from the engine's own events, so nothing here depends on time. The same rule on a
real model, over the splits 4,4, 3,5 and 2,2,4: tests/integration/test_model_families.py.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_decode.decode_config import CacheLevel, DecodeConfig
from lynx_decode.errors import DecodeError
from lynx_decode.events import Committed, Event, Rollback, Tentative
from lynx_decode.model import KVBuffers, ModelInfo, Prefill
from lynx_decode.speculative import decode_events
from tests._speculative_helpers import EOS, VOCAB, Landing, LandsWith, check_events, greedy_reference


class LayeredCache:
    def __init__(self, kv: KVBuffers, wait: Callable[[int], KVBuffers | None] | None) -> None:
        self.kv, self.wait = kv, wait
        self.layers: list[list[float]] | None = None  # read at the first forward

    @property
    def num_tokens(self) -> int:
        return self.kv.shape.tokens if self.layers is None else len(self.layers[0])

    def crop(self, num_tokens: int) -> None:
        assert self.layers is not None
        for values in self.layers:
            del values[num_tokens:]


class LayeredToyLM:
    """Next token = bucket of the sum of every layer's cached K values."""

    def __init__(self, num_layers: int, eos: bool = False) -> None:
        self.info = ModelInfo("toy-layers", num_layers, 1, 1, 4096, VOCAB,
                              frozenset({EOS}) if eos else frozenset())

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        keys = [np.asarray(token_ids[:-1], np.float32).reshape(1, -1, 1) * (i + 1)
                for i in range(self.info.num_layers)]
        kv = KVBuffers.from_layers(keys, [np.zeros_like(k) for k in keys], headroom=64)
        return Prefill(tuple(token_ids), kv, 0.0)

    def cache_from(self, kv: KVBuffers, *, wait: Callable[[int], KVBuffers | None] | None = None) -> LayeredCache:
        if wait is None and not kv.complete:
            raise DecodeError("incomplete")
        return LayeredCache(kv, wait)

    def forward(self, cache: LayeredCache, token_ids: Sequence[int]) -> np.ndarray:
        if cache.layers is None:  # each layer read once, in order, when the pass reaches it
            cache.layers = []
            for i in range(self.info.num_layers):
                kv = (cache.wait(i) if cache.wait is not None else None) or cache.kv
                cache.layers.append([float(x) for x in kv.layer(i)[0][0, :, 0]])
        rows = []
        for t in token_ids:
            for i, values in enumerate(cache.layers):
                values.append(float(t) * (i + 1))
            nxt = int(sum(map(sum, cache.layers)) // 50) % VOCAB
            row = np.zeros(VOCAB, np.float32)
            row[nxt] = 1.0
            rows.append(row)
        return np.stack(rows)


def levels_of(exact: KVBuffers, deltas: Sequence[float]) -> list[KVBuffers]:
    """The coarse levels (exact + delta in every key), then the exact one."""
    out = []
    for delta in deltas:
        layers = [exact.layer(i) for i in range(exact.shape.num_layers)]
        out.append(KVBuffers.from_layers([k + np.float32(delta) for k, _ in layers], [v for _, v in layers],
                                         headroom=exact.headroom))
    return [*out, exact]


def run(model: LayeredToyLM, ids: list[int], sources: list[KVBuffers], landed: list[set[int]],
        after: list[int], config: DecodeConfig) -> tuple[list[Event], list[Landing]]:
    """Level ``l`` has the layers ``landed[l]`` before the run; the rest of it lands after
    ``after[l]`` tentative tokens (or when the engine waits for one of them)."""
    bufs = []
    for source, layers in zip(sources, landed, strict=True):
        kv = Landing(source, cf.Future())
        for i in sorted(layers):
            kv.land(i)
        bufs.append(kv)
    chain = [CacheLevel(kv.future, kv) for kv in bufs]
    events: list[Event] = []
    for event in decode_events(model, ids, levels=chain, config=config, t0=0.0):
        events.append(event)
        tentative = sum(isinstance(e, Tentative) for e in events)
        for kv, n in zip(bufs, after, strict=True):
            if tentative >= n:
                kv.land_all()
    return events, bufs


def expected_first_levels(landed: list[set[int]], num_layers: int) -> list[int]:
    """The engine starts on the finest level complete before the run (else the coarsest);
    each layer then reads the finest level that has it."""
    last = len(landed) - 1
    floor = max((lv for lv, layers in enumerate(landed) if len(layers) == num_layers), default=0)
    return [max([floor, *(lv for lv in range(floor, last + 1) if i in landed[lv])]) for i in range(num_layers)]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), num_layers=st.integers(1, 4), planes=st.integers(2, 3),
       ids=st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=40),
       max_draft=st.integers(1, 10), n=st.integers(1, 16), eos=st.booleans())
def test_each_layer_reads_the_finest_level_in_and_the_output_is_exact(
        data: st.DataObject, num_layers: int, planes: int, ids: list[int], max_draft: int, n: int,
        eos: bool) -> None:
    model = LayeredToyLM(num_layers, eos=eos)
    exact = model.prefill(ids).kv
    deltas = data.draw(st.lists(st.sampled_from([0.0, 3.0, 17.0, 49.0]), min_size=planes - 1,
                                max_size=planes - 1))
    layer_sets = st.sets(st.integers(0, num_layers - 1))
    landed = [data.draw(layer_sets) for _ in range(planes)]
    after = [data.draw(st.integers(0, 12)) for _ in range(planes)]
    events, _ = run(model, ids, levels_of(exact, deltas), landed, after,
                    DecodeConfig(max_new_tokens=n, max_draft=max_draft))
    expected = greedy_reference(model, ids, exact, n)
    check_events(events, expected)
    m = events[-1].metrics
    assert list(m.first_pass_levels) == expected_first_levels(landed, num_layers)
    first_exact = min(m.first_pass_levels) == planes - 1
    # a first pass on exact K/V in every layer is final: committed at once, nothing to verify
    assert m.first_token_committed == first_exact == isinstance(events[0], Committed)
    if first_exact:
        assert m.verify_passes == 0 and not any(isinstance(e, Tentative | Rollback) for e in events)
    else:
        assert isinstance(events[0], Tentative) and m.verify_passes >= 1


def test_the_exact_cache_landing_ahead_of_the_pass_commits_the_first_token() -> None:
    # each layer's residual lands as the first pass reaches the layer (the exact level's
    # future resolves only with the last): the pass starts on the anchors, reads exact K/V
    # in every layer, and its token is final, with no verify pass
    model = LayeredToyLM(3)
    ids = list(range(3, 30))
    anchor, full = levels_of(model.prefill(ids).kv, [17.0])
    full_kv = Landing(full, cf.Future())
    anchor_kv = LandsWith(anchor, cf.Future(), full_kv)
    chain = [CacheLevel(anchor_kv.future, anchor_kv), CacheLevel(full_kv.future, full_kv)]
    events = list(decode_events(model, ids, levels=chain, config=DecodeConfig(max_new_tokens=6), t0=0.0))
    m = events[-1].metrics
    assert m.first_pass_levels == (1, 1, 1) and m.first_token_committed and m.verify_passes == 0
    assert [type(e) for e in events[:-1]] == [Committed] * 6
    assert list(events[-1].tokens) == greedy_reference(model, ids, full, 6)


def test_a_mixed_first_pass_is_tentative_and_verified_on_the_finest_levels() -> None:
    # split 2,2,4: layer 0 has its exact K/V, layer 1 the 4-bit level, layer 2 the anchors only;
    # the drafts (on a far-off anchor) are rolled back by a verify pass that reads, per layer,
    # the finest level in by then
    model = LayeredToyLM(3)
    ids = [7] * 25
    exact = model.prefill(ids).kv
    events, _ = run(model, ids, levels_of(exact, [49.0, 17.0]), [set(), {0, 1}, {0}], [0, 4, 4],
                    DecodeConfig(max_new_tokens=10, max_draft=8))
    m = events[-1].metrics
    assert m.first_pass_levels == (2, 1, 0) and not m.first_token_committed
    assert isinstance(events[0], Tentative) and m.verify_passes >= 1
    check_events(events, greedy_reference(model, ids, exact, 10))
    assert any(isinstance(e, Rollback) for e in events)


def test_a_layer_held_back_is_taken_when_the_pass_reaches_it() -> None:
    # a level whose layer has landed but is not yet readable (the assembler's gate held its
    # dequantization back): the engine asks the level to take it, and reads it
    model = LayeredToyLM(2)
    ids = list(range(2, 20))
    exact = model.prefill(ids).kv
    anchor, full = levels_of(exact, [17.0])
    anchor_kv = Landing(anchor, cf.Future())
    full_kv = Landing(full, cf.Future())
    taken: list[int] = []

    def take(i: int, timeout: float) -> bool:
        taken.append(i)
        full_kv.land(i)
        return True

    chain = [CacheLevel(anchor_kv.future, anchor_kv), CacheLevel(full_kv.future, full_kv, take=take)]
    events = list(decode_events(model, ids, levels=chain, config=DecodeConfig(max_new_tokens=4), t0=0.0))
    assert taken == [0, 1]
    assert events[-1].metrics.first_token_committed
    assert list(events[-1].tokens) == greedy_reference(model, ids, exact, 4)


def test_a_layer_waits_for_its_exact_kv_when_the_exact_level_is_due_within_a_step() -> None:
    # the exact level lands only when waited for (take with a timeout): with its completion
    # due within a decode step, each layer of the first pass waits for it, and the token is
    # final; due later (or unknown), the pass reads the anchors and the token is tentative
    model = LayeredToyLM(3)
    ids = list(range(2, 20))
    exact = model.prefill(ids).kv

    def run_with(eta: float | None, step_s: float | None) -> tuple[object, list[tuple[int, float]]]:
        anchor, full = levels_of(exact, [17.0])
        anchor_kv, full_kv = Landing(anchor, cf.Future()), Landing(full, cf.Future())
        asked: list[tuple[int, float]] = []

        def take(i: int, timeout: float) -> bool:
            asked.append((i, timeout))
            if timeout > 0:
                full_kv.land(i)
            return full_kv.written(i)

        chain = [CacheLevel(anchor_kv.future, anchor_kv),
                 CacheLevel(full_kv.future, full_kv, eta=lambda: eta, take=take)]
        events = list(decode_events(model, ids, levels=chain, t0=0.0,
                                    config=DecodeConfig(max_new_tokens=4, step_s=step_s)))
        assert list(events[-1].tokens) == greedy_reference(model, ids, exact, 4)  # type: ignore[union-attr]
        return events[-1].metrics, asked  # type: ignore[union-attr]

    m, asked = run_with(eta=0.01, step_s=0.05)
    assert m.first_token_committed and m.first_pass_levels == (1, 1, 1) and m.verify_passes == 0
    assert [i for i, t in asked if t > 0] == [0, 1, 2] and all(t <= 0.05 for _, t in asked)
    for eta, step in ((0.2, 0.05), (None, 0.05), (0.01, None)):
        m, asked = run_with(eta=eta, step_s=step)
        assert not m.first_token_committed and m.first_pass_levels[0] == 0, (eta, step)
        assert all(t == 0 for _, t in asked)
