"""Greedy speculative decoding: draft on the anchor-only cache, verify on the full one.

Concurrency model: threads with futures. The transport side (any thread) fills a
:class:`~lynx_decode.model.KVBuffers` per cache and resolves a
``concurrent.futures.Future`` with it (or sets an exception when the stream
fails). The engine runs in the caller's thread and only polls/waits on those
futures; all model calls happen in that one thread.

Algorithm (prompt ``ids``; both caches cover ``ids[:-1]``, see
:mod:`lynx_decode.model.protocol`):

1. Wait until the draft or the full cache is ready (whichever first). With
   ``early`` (the buffers of the cache the first step runs on, still filling),
   do not wait: the first step starts at once and waits inside each layer
   for that layer's K/V (``KVBuffers.wait_layer``), so its compute overlaps
   the transfer and only the last layers' work remains when the last bytes land.
2. Draft cache first: run ``ids[-1]`` and then each drafted token through it,
   greedily, one at a time, emitting :class:`Tentative` events, until the full
   cache is ready, ``max_draft`` tokens were drafted, or EOS was drafted.
3. Full cache: run ``[ids[-1]] + drafts`` in ONE forward pass. ``preds[i]`` is
   the greedy token after ``drafts[:i]``; keep the longest prefix where
   ``drafts[i] == preds[i]`` (``k`` tokens) plus ``preds[k]`` (the correction,
   or a bonus token when all drafts agree), crop the cache back to the prompt
   plus the ``k`` accepted drafts, and emit :class:`Rollback` (if anything was
   rejected) then :class:`Committed`.
4. Continue greedily on the full cache until ``max_new_tokens`` or EOS.

A residual that never arrives (the full future fails, or does not resolve within
``full_timeout_s`` once drafting started): with ``MissingFull.FAIL`` (default)
the run raises :class:`DecodeError`; with ``MissingFull.UNVERIFIED`` it finishes
on the anchor-only cache and reports every token as :class:`Unverified`
(``metrics.verified`` False) — never as committed.

Committed tokens equal plain greedy decoding on the full cache by construction
(up to fp32 rounding between a batched and a one-token pass; docs/design.md: exact in
all measured runs in fp32, not in bf16). With no draft future, or when the full
cache is ready before the first draft step, this is plain greedy decoding.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.events import Committed, DecodeMetrics, Done, Event, Rollback, Tentative, Unverified
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.protocol import CausalLM, LMCache
from lynx_transport.errors import LynxError

__all__ = ["DecodeConfig", "Generation", "MissingFull", "DEFAULT_MAX_DRAFT", "decode_events",
           "generate", "ready"]

DEFAULT_MAX_DRAFT = 8


class MissingFull(enum.Enum):
    """What to do when the exact (full) cache never arrives after drafting started."""

    FAIL = "fail"
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class DecodeConfig:
    """``max_draft`` bounds the tokens drafted before verification (0 disables
    drafting). ``wait_timeout_s`` bounds each wait for a cache future;
    ``full_timeout_s`` (None: ``wait_timeout_s``) bounds the wait for the full
    cache once the draft cache is in use, and ``on_missing_full`` says what
    happens when it is exceeded or the full cache fails."""

    max_new_tokens: int = 32
    max_draft: int = DEFAULT_MAX_DRAFT
    stop_at_eos: bool = True
    wait_timeout_s: float = 600.0
    full_timeout_s: float | None = None
    on_missing_full: MissingFull = MissingFull.FAIL

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_draft < 0:
            raise DecodeError(f"max_draft must be >= 0, got {self.max_draft}")
        if not self.wait_timeout_s > 0:
            raise DecodeError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        if self.full_timeout_s is not None and not self.full_timeout_s > 0:
            raise DecodeError(f"full_timeout_s must be > 0, got {self.full_timeout_s}")


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]
    metrics: DecodeMetrics


def ready(kv: KVBuffers) -> cf.Future[KVBuffers]:
    """A future already resolved with ``kv`` (a cache that is at hand)."""
    future: cf.Future[KVBuffers] = cf.Future()
    future.set_result(kv)
    return future


def generate(model: CausalLM, prompt_ids: Sequence[int], *, full: cf.Future[KVBuffers],
             draft: cf.Future[KVBuffers] | None = None, config: DecodeConfig = DecodeConfig(),
             t0: float, clock: Callable[[], float] = time.perf_counter,
             on_event: Callable[[Event], None] | None = None,
             early: KVBuffers | None = None) -> Generation:
    """Run :func:`decode_events` to the end, passing each event to ``on_event``."""
    for event in decode_events(model, prompt_ids, full=full, draft=draft, config=config,
                               t0=t0, clock=clock, early=early):
        if on_event is not None:
            on_event(event)
        if isinstance(event, Done):
            return Generation(event.tokens, event.metrics)
    raise DecodeError("generation ended without a Done event (internal error)")


def decode_events(model: CausalLM, prompt_ids: Sequence[int], *,
                  full: cf.Future[KVBuffers], draft: cf.Future[KVBuffers] | None = None,
                  config: DecodeConfig = DecodeConfig(), t0: float,
                  clock: Callable[[], float] = time.perf_counter,
                  early: KVBuffers | None = None) -> Iterator[Event]:
    """Greedy (speculative when ``draft`` is given) decoding as a stream of events.

    ``full`` resolves to the exact cache, ``draft`` to the anchor-only one; both
    must cover ``prompt_ids[:-1]``. ``t0`` is the caller's start on ``clock``.
    ``early``: the buffers ``draft`` (when drafting) or else ``full`` will
    resolve to, while they fill; the first step then starts at once and waits
    per layer (whoever fills them must ``abort`` them if they never complete).
    Raises PromptError when the prompt plus ``max_new_tokens`` exceeds the context
    window, DecodeError when a future fails or times out, a cache does not match
    the prompt, or the model fails; events already yielded stay valid (committed
    tokens are final, tentative ones void)."""
    ids = [int(t) for t in prompt_ids]
    info = model.info
    if len(ids) < 2:
        raise PromptError(f"a prompt needs at least 2 tokens, got {len(ids)}")
    if len(ids) + config.max_new_tokens > info.max_positions:
        raise PromptError(f"{len(ids)} prompt tokens + {config.max_new_tokens} new tokens "
                          f"exceed the model's context window of {info.max_positions}")
    eos = info.eos_token_ids if config.stop_at_eos else frozenset()
    n_max = config.max_new_tokens
    cached = len(ids) - 1

    def since() -> float:
        return clock() - t0

    drafting = draft is not None and config.max_draft > 0
    if early is None:
        drafting = drafting and _wait_first(full, draft, config.wait_timeout_s) is draft

    def filling(kv: KVBuffers) -> LMCache:  # the first step waits per layer
        return _cache(model, kv, cached, lambda i: kv.wait_layer(i, config.wait_timeout_s))

    drafts: list[int] = []
    ttft: float | None = None
    draft_start: float | None = None
    dcache: LMCache | None = None
    first_logits: np.ndarray | None = None
    fcache_early: LMCache | None = None
    if drafting:
        draft_start = since()
        assert draft is not None
        dcache = (filling(early) if early is not None
                  else _cache(model, _result(draft, "draft", 0.0), cached))
        x = ids[-1]
        while len(drafts) < min(config.max_draft, n_max) and not full.done():
            x = int(np.argmax(_forward(model, dcache, [x])[-1]))
            drafts.append(x)
            if ttft is None:
                ttft = since()
            yield Tentative(x, len(drafts) - 1)
            if x in eos:
                break

    elif early is not None:  # plain greedy: the first token straight off the filling cache
        fcache_early = filling(early)
        first_logits = _forward(model, fcache_early, [ids[-1]])

    timeout = config.wait_timeout_s
    if dcache is not None and config.full_timeout_s is not None:
        timeout = config.full_timeout_s
    try:
        fkv = _result(full, "full", timeout)
    except DecodeError as exc:
        if dcache is None or config.on_missing_full is MissingFull.FAIL:
            raise
        yield from _finish_unverified(model, dcache, ids, drafts, eos, n_max, str(exc),
                                      since, ttft, draft_start)
        return
    del dcache
    fcache = fcache_early if fcache_early is not None else _cache(model, fkv, cached)
    full_ready = since()
    verify_s: float | None = None
    accepted = 0
    if drafts:
        start = clock()
        preds = [int(t) for t in np.argmax(_forward(model, fcache, [ids[-1], *drafts]), axis=-1)]
        verify_s = clock() - start
        while accepted < len(drafts) and drafts[accepted] == preds[accepted]:
            accepted += 1
        fcache.crop(cached + 1 + accepted)
        commit = _truncate([*drafts[:accepted], preds[accepted]], eos, n_max)
        if accepted < len(drafts):
            yield Rollback(accepted, len(drafts) - accepted)
    elif first_logits is not None:
        commit = [int(np.argmax(first_logits[-1]))]
    else:
        commit = [int(np.argmax(_forward(model, fcache, [ids[-1]])[-1]))]
    ttfct = since()
    ttft = ttfct if ttft is None else ttft
    out = list(commit)
    yield Committed(tuple(commit), 0)
    while len(out) < n_max and out[-1] not in eos:
        token = int(np.argmax(_forward(model, fcache, [out[-1]])[-1]))
        out.append(token)
        yield Committed((token,), len(out) - 1)
    e2e = since()
    yield Done(DecodeMetrics(
        ttft_s=ttft, ttfct_s=ttfct, e2e_s=e2e,
        acceptance_rate=accepted / len(drafts) if drafts else None,
        drafted=len(drafts), accepted=accepted, new_tokens=len(out),
        speculative=bool(drafts), draft_start_s=draft_start, full_ready_s=full_ready,
        verify_s=verify_s, stopped_at_eos=out[-1] in eos), tuple(out))


def _finish_unverified(model: CausalLM, dcache: LMCache, ids: list[int], drafts: list[int],
                       eos: frozenset[int], n_max: int, reason: str,
                       since: Callable[[], float], ttft: float | None,
                       draft_start: float | None) -> Iterator[Event]:
    """Decode the rest on the anchor-only cache; every token is :class:`Unverified`."""
    out = list(drafts)
    if not out:
        out.append(int(np.argmax(_forward(model, dcache, [ids[-1]])[-1])))
        ttft = since()
    yield Unverified(tuple(out), 0)
    while len(out) < n_max and out[-1] not in eos:
        token = int(np.argmax(_forward(model, dcache, [out[-1]])[-1]))
        out.append(token)
        yield Unverified((token,), len(out) - 1)
    assert ttft is not None
    yield Done(DecodeMetrics(
        ttft_s=ttft, ttfct_s=None, e2e_s=since(), acceptance_rate=None, drafted=len(drafts),
        accepted=0, new_tokens=len(out), speculative=True, draft_start_s=draft_start,
        full_ready_s=None, verify_s=None, stopped_at_eos=out[-1] in eos, verified=False,
        unverified_reason=reason), tuple(out))


def _truncate(tokens: list[int], eos: frozenset[int], n_max: int) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[: i + 1]
            break
    return tokens[:n_max]


def _wait_first(full: cf.Future[KVBuffers], draft: cf.Future[KVBuffers] | None,
                timeout: float) -> cf.Future[KVBuffers]:
    """The future to start from: ``full`` if it is done (or there is no draft)."""
    if draft is None or full.done():
        return full
    done, _ = cf.wait([full, draft], timeout=timeout, return_when=cf.FIRST_COMPLETED)
    if not done:
        raise DecodeError(f"no KV cache arrived within {timeout} s")
    return full if full in done else draft


def _result(future: cf.Future[KVBuffers], name: str, timeout: float) -> KVBuffers:
    try:
        kv = future.result(timeout=timeout)
    except cf.TimeoutError as exc:
        raise DecodeError(f"the {name} KV cache did not arrive within {timeout} s") from exc
    except cf.CancelledError as exc:
        raise DecodeError(f"the {name} KV cache was cancelled") from exc
    except Exception as exc:
        raise DecodeError(f"the {name} KV cache failed: {exc}") from exc
    if not isinstance(kv, KVBuffers):
        raise DecodeError(f"the {name} future must resolve to KVBuffers, got "
                          f"{type(kv).__name__}")
    return kv


def _cache(model: CausalLM, kv: KVBuffers, cached: int,
           wait: Callable[[int], None] | None = None) -> LMCache:
    if kv.shape.tokens != cached:
        raise DecodeError(f"the received cache covers {kv.shape.tokens} positions; the "
                          f"prompt needs {cached} (all prompt tokens but the last)")
    return model.cache_from(kv, wait=wait)


def _forward(model: CausalLM, cache: LMCache, tokens: list[int]) -> np.ndarray:
    try:
        return model.forward(cache, tokens)
    except LynxError:
        raise
    except Exception as exc:
        raise DecodeError(f"model forward failed: {type(exc).__name__}: {exc}") from exc
