"""One accuracy case on the model: prefill once in fp32, then every scheme's cache.

The model computes in fp32 whatever the cache (docs/design.md); the cache of
``prompt[:-1]`` is the model's prefill, re-encoded per scheme through the codec
(:mod:`lynx_bench.accuracy.schemes`). Per scheme, on a fresh copy of its cache:

- fidelity: one teacher-forced pass over ``[prompt[-1]] + continuation[:-1]``,
  whose logits predict the true continuation, scored against BF16's;
- generation: greedy decoding of ``n`` tokens from ``prompt[-1]`` (no stop at
  EOS), against BF16's; a LYNX split runs the real speculative engine
  (:func:`lynx_decode.speculative.decode_events`: up to ``DEFAULT_MAX_DRAFT``
  tokens drafted on the anchor-only cache, verified in one pass on the full one,
  then greedy), whose committed tokens must be INT8's greedy tokens;
- retrieval: the canonical answer teacher-forced (NLL), and ``answer_tokens``
  greedy tokens scored by :func:`~lynx_bench.accuracy.retrieval.retrieval_score`.

LYNX's committed metrics are INT8's once its full decode is bitwise INT8's
(checked per case, ``equal_to_int8``): measured again they could only repeat them.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lynx_decode.decode_config import DEFAULT_MAX_DRAFT, CacheLevel, DecodeConfig, ready
from lynx_decode.events import Done, Tentative
from lynx_decode.model import CausalLM, KVBuffers, LMCache
from lynx_decode.speculative import decode_events

from ..sweep.config import SweepScheme, is_lynx
from .retrieval import RetrievalCase, retrieval_score
from .schemes import REFERENCE, Layer, SchemeCache, scheme_cache
from .scores import full_match, kl_divergence, perplexity, prefix_agreement, sequence_nll, top1_agreement

__all__ = ["Scored", "evaluate_text", "evaluate_retrieval", "speculative_tokens", "greedy"]

_HEADROOM = 8


@dataclass(frozen=True)
class Scored:
    """One metric's value for one scheme on one case."""

    scheme: str
    metric: str
    value: float


def _prefill(model: CausalLM, prompt: Sequence[int]) -> list[Layer]:
    pre = model.prefill(prompt)
    return [(np.asarray(pre.kv.keys[i]), np.asarray(pre.kv.values[i])) for i in range(pre.kv.shape.num_layers)]


def _buffers(layers: Sequence[Layer], headroom: int) -> KVBuffers:
    return KVBuffers.from_layers([k for k, _ in layers], [v for _, v in layers], headroom=headroom)


def greedy(model: CausalLM, cache: LMCache, last: int, n: int) -> list[int]:
    """``n`` greedy tokens after ``last`` on ``cache`` (which holds everything before it)."""
    out: list[int] = []
    token = last
    for _ in range(n):
        token = int(np.argmax(model.forward(cache, [token])[-1]))
        out.append(token)
    return out


def speculative_tokens(model: CausalLM, prompt: Sequence[int], draft: KVBuffers, full: KVBuffers,
                       n: int) -> tuple[int, ...]:
    """The speculative engine's committed tokens: drafts on ``draft`` while ``full`` is
    held back, ``full`` released once ``min(DEFAULT_MAX_DRAFT, n)`` tokens are drafted
    (as when the residual lands), then verification and greedy decoding on it."""
    pending: cf.Future[KVBuffers] = cf.Future()
    config = DecodeConfig(max_new_tokens=n, stop_at_eos=False, wait_timeout_s=120.0)
    levels = [CacheLevel(ready(draft), draft), CacheLevel(pending)]
    drafted, release = 0, min(DEFAULT_MAX_DRAFT, n)
    for event in decode_events(model, prompt, levels=levels, config=config, t0=time.perf_counter()):
        if isinstance(event, Tentative):
            drafted += 1
            if drafted == release:
                pending.set_result(full)
        elif isinstance(event, Done):
            return event.tokens
    raise AssertionError("decode_events ended without Done")  # the engine always ends with Done


def _caches(ref: Sequence[Layer], schemes: Sequence[SweepScheme]) -> Callable[[SweepScheme], SchemeCache]:
    """Each scheme's cache, INT8's kept for the LYNX checks."""
    int8: list[Layer] | None = None

    def get(scheme: SweepScheme) -> SchemeCache:
        nonlocal int8
        cache = scheme_cache(ref, scheme, int8)
        if scheme.name == "int8":
            int8 = cache.layers
        return cache

    return get


def _order(schemes: Sequence[SweepScheme]) -> list[SweepScheme]:
    """BF16 (the reference) first and INT8 before every LYNX split; BF16 is run even when not reported."""
    ref = next((s for s in schemes if s.name == REFERENCE), SweepScheme(REFERENCE, REFERENCE))
    rest = [s for s in schemes if s.name != REFERENCE]
    return [ref, *sorted(rest, key=lambda s: is_lynx(s.name))]


def evaluate_text(model: CausalLM, ids: Sequence[int], context: int, schemes: Sequence[SweepScheme], *,
                  fidelity: int | None, generation: int | None) -> tuple[list[Scored], list[Scored]]:
    """(fidelity rows, generation rows) of one text window ``ids`` (``context`` prompt
    tokens and at least ``max(fidelity, generation)`` more); None skips a workload."""
    ids = [int(t) for t in ids]
    prompt = ids[:context]
    ref_layers = _prefill(model, prompt)
    cache_of = _caches(ref_layers, schemes)
    steps = max(fidelity or 0, generation or 0)
    teacher = prompt[-1:] + ids[context : context + (fidelity or 0) - 1]
    truth = ids[context : context + (fidelity or 0)]
    reported = {s.name for s in schemes}
    fid: list[Scored] = []
    gen: list[Scored] = []
    base_logits: np.ndarray | None = None
    base_tokens: list[int] | None = None
    int8_logits: np.ndarray | None = None
    int8_tokens: list[int] | None = None
    for scheme in _order(schemes):
        sc = cache_of(scheme)
        lynx = sc.draft is not None
        kv = _buffers(sc.layers, steps + _HEADROOM)
        logits = tokens = None
        if fidelity:
            if lynx and sc.equal_to_int8 and int8_logits is not None:
                logits = int8_logits
            else:
                logits = model.forward(model.cache_from(kv), teacher)
        if generation:
            if lynx:
                assert sc.draft is not None
                tokens = list(speculative_tokens(model, prompt, _buffers(sc.draft, steps + _HEADROOM), kv,
                                                 generation))
            else:
                tokens = greedy(model, model.cache_from(kv), prompt[-1], generation)
        if scheme.name == REFERENCE:
            base_logits, base_tokens = logits, tokens
        if scheme.name == "int8":
            int8_logits, int8_tokens = logits, tokens
        if scheme.name not in reported:
            continue
        if fidelity:
            assert logits is not None and base_logits is not None
            fid += [Scored(scheme.name, "top1_agreement_vs_bf16", top1_agreement(base_logits, logits)),
                    Scored(scheme.name, "kl_vs_bf16", kl_divergence(base_logits, logits)),
                    Scored(scheme.name, "ppl", perplexity(logits, truth))]
            if lynx:
                assert sc.draft is not None
                draft = model.forward(model.cache_from(_buffers(sc.draft, steps + _HEADROOM)), teacher)
                fid += [Scored(scheme.name, "draft_top1_agreement_vs_bf16", top1_agreement(base_logits, draft)),
                        Scored(scheme.name, "equal_to_int8", float(bool(sc.equal_to_int8)))]
        if generation:
            assert tokens is not None and base_tokens is not None
            gen += [Scored(scheme.name, "full_match_vs_bf16", full_match(base_tokens, tokens)),
                    Scored(scheme.name, "prefix_agreement_vs_bf16", prefix_agreement(base_tokens, tokens))]
            if lynx:
                same = bool(sc.equal_to_int8) and (int8_tokens is None or int8_tokens == tokens)
                gen.append(Scored(scheme.name, "equal_to_int8", float(same)))
    return fid, gen


def evaluate_retrieval(model: CausalLM, case: RetrievalCase, schemes: Sequence[SweepScheme],
                       answer_tokens: int) -> list[Scored]:
    """``exact_match`` and ``answer_nll`` of every scheme on one retrieval case."""
    prompt = list(case.prompt)
    cache_of = _caches(_prefill(model, prompt), schemes)
    answer = list(case.answer_ids)
    headroom = max(len(answer), answer_tokens) + _HEADROOM
    reported = {s.name for s in schemes}
    out: list[Scored] = []
    int8: tuple[float, float] | None = None
    for scheme in _order(schemes):
        if scheme.name not in reported:
            continue
        sc = cache_of(scheme)
        if sc.draft is not None and sc.equal_to_int8 and int8 is not None:
            nll, match = int8
        else:
            kv = _buffers(sc.layers, headroom)
            nll = sequence_nll(model.forward(model.cache_from(kv), [prompt[-1], *answer[:-1]]), answer)
            text = model.detokenize(greedy(model, model.cache_from(kv), prompt[-1], answer_tokens))
            match = retrieval_score(text, case.values)
        if scheme.name == "int8":
            int8 = (nll, match)
        out += [Scored(scheme.name, "exact_match", match), Scored(scheme.name, "answer_nll", nll)]
        if sc.draft is not None:
            out.append(Scored(scheme.name, "equal_to_int8", float(bool(sc.equal_to_int8))))
    return out
