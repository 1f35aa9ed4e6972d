"""Greedy speculative decoding: draft on the coarse caches, verify on the exact one.

Concurrency model: threads with futures. The transport side (any thread) fills a
:class:`~lynx_decode.model.KVBuffers` per cache and resolves a
``concurrent.futures.Future`` with it (or sets an exception when the stream
fails). The engine runs in the caller's thread and only polls/waits on those
futures and buffers; all model calls happen in that one thread.

The caches come as *levels* (:class:`CacheLevel`), coarsest first: for a LYNX
split ``2,2,4`` the 2-bit, the 4-bit and the exact 8-bit cache; for ``4,4`` the
anchor-only draft and the exact cache; for a baseline just the exact one. Each
level has its future, optionally its buffers while they fill (a pass on them
starts at once and waits inside each layer for that layer's K/V,
``KVBuffers.wait_layer``, so compute overlaps the transfer), and optionally an
estimate of when it completes.

Algorithm (prompt ``ids``; every cache covers ``ids[:-1]``, see
:mod:`lynx_decode.model.protocol`):

0. Every pass reads, in each layer, the finest level whose layer has landed when
   the pass reaches it (a level with ``take`` is asked to make a landed layer
   readable), waiting for the pass's own level when none finer is in; while
   the pass has read exact K/V in every layer so far, a layer waits (at most
   ``step_s``) for its exact K/V when the exact level is due within a step. A
   pass is as fine as its coarsest layer.
1. Start on the coarsest level with buffers (pipelined), else on the best level
   whose future resolved first. If the first step read exact K/V in every
   layer, its token is :class:`Committed` (no verify pass) and step 4 follows;
   otherwise it emits a :class:`Tentative` token.
2. Draft further tokens on the current level (up to ``max_draft``) while the
   next level is not complete and: it has no buffers (its pass cannot start
   early, so drafting is free), or its estimated time to completion is more
   than :data:`DRAFT_MARGIN_STEPS` draft steps (compute time) away - the link
   is slow. Otherwise, or when the estimate is unknown, move on at once, so the
   next pass rides on the next level's arrival.
3. Next level: run ``[ids[-1]] + tentative`` in ONE forward pass (pipelined
   when its buffers are still filling). ``preds[i]`` is the greedy token after
   ``tentative[:i]``; keep the longest agreeing prefix (``k`` tokens) plus
   ``preds[k]`` (the correction, or a bonus token when all agree), crop that
   cache to the prompt plus the ``k`` kept tokens, and emit :class:`Rollback`
   (if anything was rejected). On an intermediate level the kept tokens and
   ``preds[k]`` stay tentative (new ones as :class:`Tentative`) and step 2
   continues there; on a pass exact in every layer they are emitted as
   :class:`Committed`. One draft alone is checked by a one-token pass over
   ``[ids[-1]]`` (no bonus token: the next step makes it): a batched pass of
   two tokens costs a one-token pass and a half or more on CPU (the weight
   products leave the matrix-vector path; docs/design.md, "Measured facts"),
   and the first committed token waits for that pass.
4. Continue greedily on the exact cache until ``max_new_tokens`` or EOS.

So the first committed token follows the exact cache's last byte by about one
layer plus the LM head, whatever was drafted.

A level that never arrives (its future fails, or a pass on it does not finish
within ``full_timeout_s`` once drafting started): with ``MissingFull.FAIL``
(default) the run raises :class:`DecodeError`; with ``MissingFull.UNVERIFIED``
it finishes on the best cache it has and reports every token as
:class:`Unverified` (``metrics.verified`` False) — never as committed.

Committed tokens equal plain greedy decoding on the full cache by construction
(up to fp32 rounding between a batched and a one-token pass; docs/design.md: exact in
all measured runs in fp32, not in bf16). With one level, or when the exact cache
is complete before the first step, this is plain greedy decoding.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from lynx_decode.decode_config import CacheLevel, DecodeConfig, Generation, MissingFull
from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.events import Committed, DecodeMetrics, Done, Event, Rollback, Tentative, Unverified
from lynx_decode.model.buffers import KVBuffers
from lynx_decode.model.protocol import CausalLM, LMCache
from lynx_transport.errors import LynxError

__all__ = ["decode_events", "generate", "DRAFT_MARGIN_STEPS"]

#: Draft another token only while the next level is more than this many draft steps
#: away (a pass over the drafts costs about 1.5-2.5 steps at 1k-4k tokens, docs/design.md).
DRAFT_MARGIN_STEPS = 3.0


def generate(model: CausalLM, prompt_ids: Sequence[int], *, full: cf.Future[KVBuffers] | None = None,
             draft: cf.Future[KVBuffers] | None = None, config: DecodeConfig = DecodeConfig(),
             t0: float, clock: Callable[[], float] = time.perf_counter,
             on_event: Callable[[Event], None] | None = None,
             early: KVBuffers | None = None, levels: Sequence[CacheLevel] | None = None) -> Generation:
    """Run :func:`decode_events` to the end, passing each event to ``on_event``."""
    for event in decode_events(model, prompt_ids, full=full, draft=draft, config=config,
                               t0=t0, clock=clock, early=early, levels=levels):
        if on_event is not None:
            on_event(event)
        if isinstance(event, Done):
            return Generation(event.tokens, event.metrics)
    raise DecodeError("generation ended without a Done event (internal error)")


def _as_levels(full: cf.Future[KVBuffers] | None, draft: cf.Future[KVBuffers] | None,
               early: KVBuffers | None, max_draft: int) -> list[CacheLevel]:
    if full is None:
        raise DecodeError("decode_events needs the full future or levels")
    if draft is None or max_draft == 0:
        return [CacheLevel(full, early)]
    return [CacheLevel(draft, early), CacheLevel(full)]


def decode_events(model: CausalLM, prompt_ids: Sequence[int], *,
                  full: cf.Future[KVBuffers] | None = None, draft: cf.Future[KVBuffers] | None = None,
                  config: DecodeConfig = DecodeConfig(), t0: float,
                  clock: Callable[[], float] = time.perf_counter,
                  early: KVBuffers | None = None,
                  levels: Sequence[CacheLevel] | None = None) -> Iterator[Event]:
    """Greedy (speculative when there is more than one level) decoding as a stream of events.

    ``levels``: the caches coarsest first, the last one exact (see
    :class:`CacheLevel`). Or, the two-level shorthand: ``full`` resolves to the
    exact cache, ``draft`` to the anchor-only one, and ``early`` is the buffers
    ``draft`` (when drafting) or else ``full`` will resolve to, while they fill.
    Every cache must cover ``prompt_ids[:-1]``. ``t0`` is the caller's start on
    ``clock``. Whoever fills buffers must ``abort`` them if they never complete.
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
    chain = list(levels) if levels is not None else _as_levels(full, draft, early, config.max_draft)
    if not chain:
        raise DecodeError("decode_events needs at least one cache level")
    if config.max_draft == 0:
        chain = chain[-1:]
    run = _Generation(model, ids, chain, config, t0, clock)
    yield from run.events()


class _Generation:
    """One generation (the state :func:`decode_events` walks through)."""

    def __init__(self, model: CausalLM, ids: list[int], chain: list[CacheLevel], config: DecodeConfig,
                 t0: float, clock: Callable[[], float]) -> None:
        self.model, self.ids, self.chain, self.config = model, ids, chain, config
        self.t0, self.clock = t0, clock
        self.cached = len(ids) - 1
        self.eos = model.info.eos_token_ids if config.stop_at_eos else frozenset()
        self.n_max = config.max_new_tokens
        self.last = len(chain) - 1
        self.waited = 0.0  # seconds the current pass spent waiting for layers
        self.first_levels: tuple[int, ...] = ()  # the level each layer of the first pass read
        self.verify_passes = 0
        self.step_s = config.step_s  # a decode step: the hint, then what the first step took

    def since(self) -> float:
        return self.clock() - self.t0

    # -- caches ----------------------------------------------------------------------------
    def _best_done(self) -> int:
        done = [i for i, level in enumerate(self.chain) if level.future.done()]
        return max(done, default=-1)

    def _start_level(self) -> int:
        """The level the first step runs on: the coarsest with buffers (pipelined),
        unless a finer one is already complete; else the best whose future resolved first."""
        best = self._best_done()
        if best >= 0:
            return best
        if self.chain[0].buffers is not None or len(self.chain) == 1:
            return 0  # (one level: its future is waited on when the cache opens)
        pending = [level.future for level in self.chain]
        done, _ = cf.wait(pending, timeout=self.config.wait_timeout_s, return_when=cf.FIRST_COMPLETED)
        if not done:
            raise DecodeError(f"no KV cache arrived within {self.config.wait_timeout_s} s")
        return self._best_done()

    def _source(self, index: int) -> KVBuffers | None:
        """Level ``index``'s buffers: its resolved cache, else the buffers it fills (None: neither)."""
        level = self.chain[index]
        future = level.future
        if future.done() and not future.cancelled() and future.exception() is None:
            kv = future.result()
            return kv if isinstance(kv, KVBuffers) else None
        return level.buffers

    def _readable(self, index: int, layer: int, timeout: float = 0.0) -> KVBuffers | None:
        """Level ``index``'s buffers when their layer ``layer`` can be read now, or within
        ``timeout`` seconds (only a level with ``take`` can be waited on), else None."""
        kv = self._source(index)
        if kv is None:
            return None
        take = self.chain[index].take
        return kv if kv.written(layer) or (take is not None and take(layer, max(0.0, timeout))) else None

    def _exact_within_a_step(self) -> float:
        """How long a layer waits for its exact K/V rather than read a coarser level: the
        exact level's time to completion when that is within one decode step (a pass read
        on a coarser layer costs a verify pass later, at least a step), else 0."""
        eta = self.chain[self.last].eta
        remaining = eta() if eta is not None else None
        if remaining is None or self.step_s is None or remaining > self.step_s:
            return 0.0
        return min(self.step_s, 2 * remaining + 0.002)

    def _open(self, floor: int, timeout: float) -> tuple[LMCache, list[int]]:
        """A model cache for a pass on level ``floor`` or finer, and the level each layer
        read (filled in as the pass reaches it): layer ``i`` reads the finest level whose
        layer ``i`` is in at that moment, waiting (until ``timeout`` seconds from now) for
        ``floor``'s when none is. A pass that read the exact level in every layer is exact."""
        level = self.chain[floor]
        name = "full" if floor == self.last else ("draft" if floor == 0 else f"level-{floor} draft")
        used = [floor] * self.model.info.num_layers
        finer = range(self.last, floor, -1)
        if level.buffers is not None and not level.future.done():
            base = level.buffers  # filling: the pass starts now and waits per layer
        else:
            base = _result(level.future, name, timeout)
            if floor == self.last or not base.complete:  # (the model refuses an incomplete one)
                return _cache(self.model, base, self.cached), used
        deadline = time.monotonic() + timeout

        def finest(i: int) -> KVBuffers | None:
            for index in finer:
                kv = self._readable(index, i)
                if kv is not None:
                    used[i] = index
                    return kv
            return None

        def wait(i: int) -> KVBuffers | None:
            start = time.perf_counter()
            try:
                kv = finest(i)
                if kv is None and not base.written(i):
                    try:
                        base.wait_layer(i, max(0.0, deadline - time.monotonic()))
                    except DecodeError as exc:
                        raise DecodeError(f"the {name} KV cache failed: {exc}") from exc
                    kv = finest(i)  # a finer level may have landed meanwhile
                if used[i] != self.last and all(u == self.last for u in used[:i]):
                    # exact so far: wait a little for this layer's exact K/V when the exact
                    # level is due within a step, so the pass stays exact (no verify pass)
                    exact = self._readable(self.last, i, min(self._exact_within_a_step(),
                                                             deadline - time.monotonic()))
                    if exact is not None:
                        used[i] = self.last
                        return exact
                return kv
            finally:
                self.waited += time.perf_counter() - start

        return _cache(self.model, base, self.cached, wait), used

    def _timed_forward(self, cache: LMCache, tokens: list[int]) -> tuple[np.ndarray, float]:
        """Logits and the pass's compute time (wall time less the time spent waiting for layers)."""
        self.waited = 0.0
        start = self.clock()
        logits = _forward(self.model, cache, tokens)
        return logits, max(0.0, self.clock() - start - self.waited)

    def _should_draft(self, nxt: int, step_s: float | None, drafted: int) -> bool:
        """Draft one more token on the current level before the pass on level ``nxt``?"""
        level = self.chain[nxt]
        if drafted >= min(self.config.max_draft, self.n_max) or level.future.done():
            return False
        if level.buffers is None:  # the pass cannot start before the level is complete: drafting is free
            return True
        if level.eta is None or step_s is None:
            return False
        eta = level.eta()
        return eta is not None and eta > DRAFT_MARGIN_STEPS * step_s

    # -- the run ---------------------------------------------------------------------------
    def events(self) -> Iterator[Event]:
        cur = self._start_level()
        if cur == self.last:
            cache, used = self._open(cur, self.config.wait_timeout_s)
            self.first_levels = tuple(used)
            yield from self._greedy(cache)
            return
        draft_start = self.since()
        cache, used = self._open(cur, self.config.wait_timeout_s)
        logits, step_s = self._timed_forward(cache, [self.ids[-1]])
        self.step_s = step_s
        toks = [int(np.argmax(logits[-1]))]
        self.first_levels = tuple(used)
        cur = min(used)
        if cur == self.last:  # every layer read exact K/V: the token is final, as INT8's first is
            yield from self._greedy(cache, toks)
            return
        ttft = self.since()
        yield Tentative(toks[0], 0)
        full_timeout = self.config.full_timeout_s or self.config.wait_timeout_s
        while True:
            nxt = max(cur + 1, self._best_done())
            while toks[-1] not in self.eos and self._should_draft(nxt, step_s, len(toks)):
                with _sharing_cpu(self.model):  # the next level is still landing: leave a core to it
                    logits, step_s = self._timed_forward(cache, [toks[-1]])
                toks.append(int(np.argmax(logits[-1])))
                yield Tentative(toks[-1], len(toks) - 1)
                nxt = max(nxt, self._best_done())
            taken = self.since()
            try:
                ncache, used = self._open(nxt, full_timeout if nxt == self.last else self.config.wait_timeout_s)
                pass_start = self.clock()
                # one draft: a one-token pass checks it (no bonus token; see step 3 above)
                inputs = [self.ids[-1], *toks] if len(toks) > 1 else [self.ids[-1]]
                preds = [int(t) for t in np.argmax(_forward(self.model, ncache, inputs), axis=-1)]
                pass_s = self.clock() - pass_start
                self.verify_passes += 1
                nxt = min(used)  # the pass is as fine as its coarsest layer
            except DecodeError as exc:
                if self.config.on_missing_full is MissingFull.FAIL:
                    raise
                yield from _finish_unverified(self.model, cache, self.ids, toks, self.eos, self.n_max,
                                              str(exc), self.since, ttft, draft_start)
                return
            accepted = 0
            while accepted < len(toks) and toks[accepted] == preds[accepted]:
                accepted += 1
            if accepted < len(preds):  # a correction, or the bonus token after every draft
                ncache.crop(self.cached + 1 + accepted)
                kept = _truncate([*toks[:accepted], preds[accepted]], self.eos, self.n_max)
            else:  # the one draft checked without a bonus token: the cache holds ids[-1] alone
                kept = list(toks)
            if accepted < len(toks):
                yield Rollback(accepted, len(toks) - accepted)
            if nxt == self.last:
                yield from self._greedy(ncache, kept, (toks, accepted, ttft, draft_start, taken, pass_s))
                return
            for position in range(accepted, len(kept)):
                yield Tentative(kept[position], position)
            toks, cache, cur = kept, ncache, nxt

    def _greedy(self, fcache: LMCache, commit: list[int] | None = None,
                spec: tuple[list[int], int, float, float, float, float] | None = None) -> Iterator[Event]:
        """Commit ``commit`` (the verified tokens; None: greedy from the start, the
        first token too) and decode greedily on the exact cache ``fcache`` to the end;
        ``spec`` (what was drafted, accepted and when) makes the metrics speculative."""
        full_ready = self.since()
        if commit is None:
            commit = [int(np.argmax(_forward(self.model, fcache, [self.ids[-1]])[-1]))]
        ttfct = self.since()
        out = list(commit)
        yield Committed(tuple(commit), 0)
        while len(out) < self.n_max and out[-1] not in self.eos:
            token = int(np.argmax(_forward(self.model, fcache, [out[-1]])[-1]))
            out.append(token)
            yield Committed((token,), len(out) - 1)
        e2e = self.since()
        if spec is None:
            yield Done(DecodeMetrics(
                ttft_s=ttfct, ttfct_s=ttfct, e2e_s=e2e, acceptance_rate=None, drafted=0, accepted=0,
                new_tokens=len(out), speculative=False, draft_start_s=None, full_ready_s=full_ready,
                verify_s=None, stopped_at_eos=out[-1] in self.eos, first_token_committed=True,
                first_pass_levels=self.first_levels), tuple(out))
            return
        toks, accepted, ttft, draft_start, taken, pass_s = spec
        yield Done(DecodeMetrics(
            ttft_s=ttft, ttfct_s=ttfct, e2e_s=e2e, acceptance_rate=accepted / len(toks),
            drafted=len(toks), accepted=accepted, new_tokens=len(out), speculative=True,
            draft_start_s=draft_start, full_ready_s=taken, verify_s=pass_s,
            stopped_at_eos=out[-1] in self.eos, verify_passes=self.verify_passes,
            first_pass_levels=self.first_levels), tuple(out))


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


def _sharing_cpu(model: CausalLM) -> contextlib.AbstractContextManager[None]:
    """``model.sharing_cpu()`` when the model has it (``HFCausalLM``: one torch thread
    fewer, a core left to the transport); nothing otherwise."""
    share = getattr(model, "sharing_cpu", None)
    return share() if share is not None else contextlib.nullcontext()


def _truncate(tokens: list[int], eos: frozenset[int], n_max: int) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[: i + 1]
            break
    return tokens[:n_max]


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
           wait: Callable[[int], KVBuffers | None] | None = None) -> LMCache:
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
