"""The speculative engine's logic on a tiny deterministic model: committed
tokens equal plain greedy decoding on the full cache for any draft quality,
draft length and arrival time of the full cache; events are consistent; failures
never commit tentative tokens; metrics follow the injected clock.

The real model runs the same checks in tests/integration/test_speculative_model.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_decode.decode_config import DecodeConfig, ready
from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.events import Committed, Done, Event, Rollback, Tentative
from lynx_decode.model import KVBuffers, KVShape
from lynx_decode.speculative import decode_events, generate
from tests._speculative_helpers import (
    EOS,
    STEP_S,
    VOCAB,
    Clock,
    LandsWhenAwaited,
    ToyCache,
    ToyLM,
    check_events,
    greedy_reference,
)


def offset(kv: KVBuffers, delta: float) -> KVBuffers:
    out = KVBuffers(kv.shape)
    out.write_layer(0, kv.keys[0] + np.float32(delta), kv.values[0])
    return out


def drive(model: ToyLM, ids: list[int], full_kv: KVBuffers, draft_kv: KVBuffers | None,
          full_after: int, config: DecodeConfig, clock: Clock | None = None) -> list[Event]:
    """Run the engine; resolve the full cache after ``full_after`` tentative tokens."""
    full = LandsWhenAwaited(full_kv)
    draft = ready(draft_kv) if draft_kv is not None else None
    if full_after == 0 or draft is None:
        full.set_result(full_kv)
    events: list[Event] = []
    for event in decode_events(model, ids, full=full, draft=draft, config=config,
                               t0=clock() if clock else 0.0, clock=clock or Clock()):
        events.append(event)
        if sum(isinstance(e, Tentative) for e in events) == full_after and not full.done():
            full.set_result(full_kv)
    return events


prompts = st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ids=prompts, delta=st.sampled_from([0.0, 3.0, 17.0, 49.0, 120.0]),
       max_draft=st.integers(0, 12), n=st.integers(1, 20), full_after=st.integers(0, 14),
       eos=st.booleans())
def test_committed_tokens_equal_greedy_on_full_cache(
        ids: list[int], delta: float, max_draft: int, n: int, full_after: int,
        eos: bool) -> None:
    model = ToyLM(eos=eos)
    full_kv = model.prefill(ids).kv
    expected = greedy_reference(model, ids, full_kv, n)
    config = DecodeConfig(max_new_tokens=n, max_draft=max_draft)
    events = drive(model, ids, full_kv, offset(full_kv, delta), full_after, config)
    check_events(events, expected)
    metrics = events[-1].metrics
    tentative = [e for e in events if isinstance(e, Tentative)]
    assert metrics.drafted == len(tentative) <= min(max_draft, n)
    assert metrics.accepted <= metrics.drafted
    if metrics.drafted:
        assert metrics.acceptance_rate == metrics.accepted / metrics.drafted
        assert metrics.verify_passes >= 1
        if metrics.drafted > 1:
            assert model.calls.count(metrics.drafted + 1) >= 1  # one verify pass for all drafts
        else:  # one draft: checked by a one-token pass, never a batched one
            assert 2 not in model.calls, model.calls
    else:
        assert metrics.acceptance_rate is None
    assert metrics.new_tokens == len(expected)


def test_exact_draft_cache_accepts_everything() -> None:
    model = ToyLM(eos=False)
    ids = list(range(1, 30))
    kv = model.prefill(ids).kv
    events = drive(model, ids, kv, offset(kv, 0.0), full_after=6,
                   config=DecodeConfig(max_new_tokens=16, max_draft=8))
    metrics = events[-1].metrics
    assert (metrics.drafted, metrics.accepted, metrics.acceptance_rate) == (6, 6, 1.0)
    assert not any(isinstance(e, Rollback) for e in events)
    # the verify pass yields the 6 drafts plus a bonus token in one Committed event
    first_commit = next(e for e in events if isinstance(e, Committed))
    assert len(first_commit.tokens) == 7


def test_bad_draft_rolls_back() -> None:
    model = ToyLM(eos=False)
    ids = [7] * 20
    kv = model.prefill(ids).kv
    events = drive(model, ids, kv, offset(kv, 25.0), full_after=8,
                   config=DecodeConfig(max_new_tokens=12, max_draft=8))
    rollbacks = [e for e in events if isinstance(e, Rollback)]
    assert len(rollbacks) == 1
    metrics = events[-1].metrics
    assert rollbacks[0] == Rollback(metrics.accepted, metrics.drafted - metrics.accepted)
    assert metrics.accepted < metrics.drafted == 8
    check_events(events, greedy_reference(model, ids, kv, 12))


def test_metrics_follow_the_injected_clock() -> None:
    clock = Clock()
    model = ToyLM(eos=False, clock=clock)
    ids = list(range(1, 10))
    kv = model.prefill(ids).kv
    t0 = clock()
    events = drive(model, ids, kv, offset(kv, 0.0), full_after=3,
                   config=DecodeConfig(max_new_tokens=10, max_draft=8), clock=clock)
    m = events[-1].metrics
    # 3 draft steps, 1 verify pass (commits 4 tokens), 6 more steps
    assert m.ttft_s == pytest.approx(STEP_S)
    assert m.ttfct_s == pytest.approx(4 * STEP_S)
    assert m.e2e_s == pytest.approx(10 * STEP_S)
    assert m.verify_s == pytest.approx(STEP_S)
    assert m.draft_start_s == 0.0 and m.full_ready_s == pytest.approx(3 * STEP_S)
    assert clock() - t0 == pytest.approx(10 * STEP_S)


def test_non_speculative_run_has_equal_ttft_and_ttfct() -> None:
    clock = Clock()
    model = ToyLM(eos=False, clock=clock)
    ids = list(range(1, 10))
    kv = model.prefill(ids).kv
    result = generate(model, ids, full=ready(kv), config=DecodeConfig(max_new_tokens=5),
                      t0=clock(), clock=clock)
    m = result.metrics
    assert m.ttft_s == m.ttfct_s == pytest.approx(STEP_S)
    assert (m.drafted, m.acceptance_rate, m.speculative) == (0, None, False)
    assert list(result.tokens) == greedy_reference(ToyLM(eos=False), ids, kv, 5)


def test_full_cache_ready_first_means_no_drafting() -> None:
    model = ToyLM(eos=False)
    ids = list(range(1, 10))
    kv = model.prefill(ids).kv
    result = generate(model, ids, full=ready(kv), draft=ready(offset(kv, 9.0)),
                      config=DecodeConfig(max_new_tokens=5), t0=0.0)
    assert result.metrics.drafted == 0


def test_eos_stops_generation_and_is_committed() -> None:
    model = ToyLM(eos=True)
    # find a prompt whose greedy continuation hits EOS early
    for start in range(1, VOCAB):
        ids = [start] * 3
        kv = model.prefill(ids).kv
        ref = greedy_reference(model, ids, kv, 30)
        if ref[-1] == EOS and len(ref) < 30:
            break
    else:
        pytest.fail("no EOS prompt found")
    events = drive(model, ids, kv, offset(kv, 0.0), full_after=30,
                   config=DecodeConfig(max_new_tokens=30, max_draft=30))
    check_events(events, ref)
    assert events[-1].metrics.stopped_at_eos


def test_drafting_stops_promptly_when_full_cache_lands_from_another_thread() -> None:
    model = ToyLM(eos=False)
    ids = list(range(1, 40))
    kv = model.prefill(ids).kv
    full: cf.Future[KVBuffers] = cf.Future()
    three = threading.Event()
    tentatives: list[int] = []

    def on_event(event: Event) -> None:
        if isinstance(event, Tentative):
            tentatives.append(event.token)
            if len(tentatives) == 3:
                three.set()
                landed.wait(5)

    landed = threading.Event()

    def transport() -> None:
        three.wait(5)
        full.set_result(kv)
        landed.set()

    thread = threading.Thread(target=transport)
    thread.start()
    result = generate(model, ids, full=full, draft=ready(offset(kv, 0.0)),
                      config=DecodeConfig(max_new_tokens=20, max_draft=16), t0=0.0,
                      on_event=on_event)
    thread.join()
    assert result.metrics.drafted == 3
    assert list(result.tokens) == greedy_reference(model, ids, kv, 20)


def test_failed_full_cache_raises_and_commits_nothing() -> None:
    model = ToyLM(eos=False)
    ids = list(range(1, 20))
    kv = model.prefill(ids).kv
    full: cf.Future[KVBuffers] = cf.Future()
    events: list[Event] = []
    with pytest.raises(DecodeError, match="full KV cache failed"):
        for event in decode_events(model, ids, full=full, draft=ready(kv),
                                   config=DecodeConfig(max_draft=8), t0=0.0):
            events.append(event)
            if len(events) == 2:
                full.set_exception(ConnectionError("peer died"))
    assert events and all(isinstance(e, Tentative) for e in events)


def test_failed_draft_cache_raises() -> None:
    model = ToyLM()
    ids = list(range(1, 20))
    draft: cf.Future[KVBuffers] = cf.Future()
    draft.set_exception(OSError("lane reset"))
    with pytest.raises(DecodeError, match="draft KV cache failed"):
        generate(model, ids, full=cf.Future(), draft=draft, t0=0.0)


def test_timeout_waiting_for_caches_raises() -> None:
    model = ToyLM()
    config = DecodeConfig(wait_timeout_s=0.05)
    with pytest.raises(DecodeError, match="within 0.05 s"):
        generate(model, [1, 2, 3], full=cf.Future(), draft=cf.Future(), config=config, t0=0.0)
    kv = model.prefill([1, 2, 3]).kv
    with pytest.raises(DecodeError, match="full KV cache did not arrive"):
        generate(model, [1, 2, 3], full=cf.Future(), draft=ready(kv),
                 config=DecodeConfig(wait_timeout_s=0.05, max_draft=2), t0=0.0)


def test_cache_that_does_not_match_the_prompt_is_rejected() -> None:
    model = ToyLM()
    kv = model.prefill([1, 2, 3, 4]).kv
    with pytest.raises(DecodeError, match="covers 3 positions; the prompt needs 4"):
        generate(model, [1, 2, 3, 4, 5], full=ready(kv), t0=0.0)


def test_incomplete_cache_is_rejected() -> None:
    model = ToyLM()
    kv = KVBuffers(KVShape(1, 1, 2, 1))
    with pytest.raises(DecodeError):
        generate(model, [1, 2, 3], full=ready(kv), t0=0.0)


def test_prompt_errors() -> None:
    model = ToyLM(max_positions=50)
    kv = model.prefill(list(range(1, 41))).kv
    with pytest.raises(PromptError, match="context window of 50"):
        generate(model, list(range(1, 41)), full=ready(kv),
                 config=DecodeConfig(max_new_tokens=11), t0=0.0)
    with pytest.raises(PromptError, match="at least 2 tokens"):
        generate(model, [1], full=ready(kv), t0=0.0)


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_draft": -1},
                                    {"wait_timeout_s": 0.0}])
def test_bad_config_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(DecodeError):
        DecodeConfig(**kwargs)  # type: ignore[arg-type]


def test_model_failure_is_a_decode_error() -> None:
    class Broken(ToyLM):
        def forward(self, cache: ToyCache, token_ids: Sequence[int]) -> np.ndarray:
            raise RuntimeError("out of memory")

    model = Broken()
    kv = model.prefill([1, 2, 3]).kv
    with pytest.raises(DecodeError, match="out of memory"):
        generate(model, [1, 2, 3], full=ready(kv), t0=0.0)


def _never_arriving_full(model: ToyLM, ids: list[int], policy, fail_after: int | None):
    """Drive a run whose full cache fails after ``fail_after`` drafts (None: never arrives)."""
    from lynx_decode.decode_config import DecodeConfig as Config

    kv = model.prefill(ids).kv
    draft_kv = offset(kv, 3.0)
    full: cf.Future[KVBuffers] = cf.Future()
    events: list[Event] = []
    config = Config(max_new_tokens=12, max_draft=4, full_timeout_s=0.05, on_missing_full=policy)
    for event in decode_events(model, ids, full=full, draft=ready(draft_kv), config=config, t0=0.0):
        events.append(event)
        if fail_after is not None and len(events) == fail_after:
            full.set_exception(ConnectionError("residual lane lost"))
    return events, draft_kv


@pytest.mark.parametrize("fail_after", [2, None])
def test_missing_residual_can_finish_on_the_anchor_marked_unverified(fail_after) -> None:
    from lynx_decode.decode_config import MissingFull
    from lynx_decode.events import Unverified

    model = ToyLM(eos=False)
    ids = list(range(1, 30))
    events, draft_kv = _never_arriving_full(model, ids, MissingFull.UNVERIFIED, fail_after)
    assert not any(isinstance(e, (Committed, Rollback)) for e in events)
    unverified = [t for e in events if isinstance(e, Unverified) for t in e.tokens]
    tentative = [e.token for e in events if isinstance(e, Tentative)]
    assert unverified[: len(tentative)] == tentative  # drafts are re-issued, never committed
    done = events[-1]
    assert isinstance(done, Done) and done.metrics.verified is False
    assert done.metrics.ttfct_s is None
    assert re.search("full KV cache (failed|did not arrive)", done.metrics.unverified_reason)
    assert list(done.tokens) == unverified == greedy_reference(model, ids, draft_kv, 12)


@pytest.mark.parametrize("fail_after", [2, None])
def test_missing_residual_fails_by_default_within_the_bound(fail_after) -> None:
    from lynx_decode.decode_config import MissingFull

    model = ToyLM(eos=False)
    with pytest.raises(DecodeError, match="full KV cache (failed|did not arrive within 0.05 s)"):
        _never_arriving_full(model, list(range(1, 30)), MissingFull.FAIL, fail_after)


def _filled_later(kv: KVBuffers, future: cf.Future, delay: float) -> tuple[KVBuffers, threading.Thread]:
    """Empty buffers of ``kv``'s shape that another thread fills after ``delay`` s,
    then resolves ``future`` with (like the transport's assembler)."""
    out = KVBuffers(kv.shape)

    def fill() -> None:
        threading.Event().wait(delay)
        out.write_layer(0, kv.keys[0], kv.values[0])
        future.set_result(out)

    thread = threading.Thread(target=fill)
    thread.start()
    return out, thread


class RecordsFirstStep(ToyLM):
    """Records whether the cache a forward pass starts on was still filling."""

    def __init__(self) -> None:
        super().__init__(eos=False)
        self.started_unfilled: list[bool] = []

    def forward(self, cache: ToyCache, token_ids: Sequence[int]) -> np.ndarray:
        if cache.pending is not None:
            self.started_unfilled.append(not cache.pending[0].complete)
        return super().forward(cache, token_ids)


@pytest.mark.parametrize("speculative", [True, False])
def test_early_first_step_starts_before_the_cache_lands_and_decodes_the_same(speculative) -> None:
    model = RecordsFirstStep()
    ids = [5, 9, 30, 2, 17, 8]
    kv = model.prefill(ids).kv
    expected = greedy_reference(model, ids, kv, 10)
    # speculative: the residual lands when the engine waits for it, after drafting
    full: cf.Future = LandsWhenAwaited(kv) if speculative else cf.Future()
    draft: cf.Future | None = cf.Future() if speculative else None
    filling, thread = _filled_later(offset(kv, 0.0) if speculative else kv,
                                    draft if speculative else full, 0.2)
    model.started_unfilled.clear()
    events = list(decode_events(model, ids, full=full, draft=draft,
                                config=DecodeConfig(max_new_tokens=10), t0=0.0, early=filling))
    thread.join()
    assert model.started_unfilled[0]  # the first step began before its cache landed
    check_events(events, expected)
    assert any(isinstance(e, Tentative) for e in events) == speculative


def test_early_first_step_fails_cleanly_when_the_cache_never_lands() -> None:
    model = ToyLM(eos=False)
    ids = [5, 9, 30, 2]
    kv = model.prefill(ids).kv
    filling = KVBuffers(kv.shape)
    full: cf.Future = cf.Future()
    threading.Timer(0.05, filling.abort, (DecodeError("stream failed"),)).start()
    with pytest.raises(DecodeError, match="will not arrive: stream failed"):
        list(decode_events(model, ids, full=full, config=DecodeConfig(max_new_tokens=4),
                           t0=0.0, early=filling))
    filling2 = KVBuffers(kv.shape)
    with pytest.raises(DecodeError, match="did not arrive within"):
        list(decode_events(model, ids, full=cf.Future(),
                           config=DecodeConfig(max_new_tokens=4, wait_timeout_s=0.05),
                           t0=0.0, early=filling2))


def test_drafting_while_the_next_cache_lands_leaves_a_core_to_the_transport() -> None:
    class SharingLM(ToyLM):
        shared = 0

        def sharing_cpu(self):
            import contextlib

            @contextlib.contextmanager
            def share():
                SharingLM.shared += 1
                yield

            return share()

    model = SharingLM(eos=False)
    ids = list(range(1, 30))
    kv = model.prefill(ids).kv
    events = drive(model, ids, kv, offset(kv, 0.0), full_after=5,
                   config=DecodeConfig(max_new_tokens=12, max_draft=8))
    assert events[-1].metrics.drafted == 5
    assert SharingLM.shared == 4  # every draft step after the first ran inside sharing_cpu()
