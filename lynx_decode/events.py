"""Token events of a generation, for embedders, and the per-run metrics.

Positions count generated tokens from 0 (the first token after the prompt).

- :class:`Tentative`: a speculative token drafted from the anchor-only cache.
  It may be rolled back; never treat it as output.
- :class:`Rollback`: tentative tokens at positions ``>= from_position`` are
  withdrawn (``n_rejected`` of them). Always precedes the :class:`Committed`
  event that replaces them.
- :class:`Committed`: verified tokens at positions ``position ..``. Committed
  tokens are final: they are never rolled back, and the concatenation of every
  ``Committed.tokens`` is the output.
- :class:`Unverified`: only with ``MissingFull.UNVERIFIED`` when the exact cache
  never arrived: tokens at positions ``position ..`` decoded on the anchor-only
  cache. They are the output of that run, explicitly NOT verified against the
  8-bit cache; the first one re-issues every tentative token shown so far.
- :class:`Done`: the last event, with the run's :class:`DecodeMetrics`
  (``metrics.verified`` is False after :class:`Unverified` tokens).

A failure mid-generation raises :class:`~lynx_transport.errors.DecodeError`
instead of yielding further events; tentative tokens seen before it are void.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tentative", "Committed", "Rollback", "Unverified", "Done", "DecodeMetrics", "Event"]


@dataclass(frozen=True)
class Tentative:
    token: int
    position: int


@dataclass(frozen=True)
class Committed:
    tokens: tuple[int, ...]
    position: int


@dataclass(frozen=True)
class Rollback:
    from_position: int
    n_rejected: int


@dataclass(frozen=True)
class Unverified:
    tokens: tuple[int, ...]
    position: int


@dataclass(frozen=True)
class DecodeMetrics:
    """Per-run metrics, named as in docs/design.md. Times are seconds from the
    caller's ``t0`` on the caller's clock. ``acceptance_rate`` is None when
    nothing was drafted (non-speculative schemes, or the full cache won the race).
    ``verified`` is False when the run finished on the anchor-only cache
    (``MissingFull.UNVERIFIED``); then ``ttfct_s`` and ``full_ready_s`` are None
    (nothing was committed) and ``unverified_reason`` says why.
    ``first_token_committed``: the first token came out final (one level, or a first
    pass that read exact K/V in every layer), with no verify pass; ``verify_passes``
    counts the passes over drafted tokens; ``first_pass_levels`` is the level (0:
    coarsest) each layer of the first pass read."""

    ttft_s: float
    ttfct_s: float | None
    e2e_s: float
    acceptance_rate: float | None
    drafted: int
    accepted: int
    new_tokens: int
    speculative: bool
    draft_start_s: float | None
    full_ready_s: float | None
    verify_s: float | None
    stopped_at_eos: bool
    verified: bool = True
    unverified_reason: str | None = None
    first_token_committed: bool = False
    verify_passes: int = 0
    first_pass_levels: tuple[int, ...] = ()


@dataclass(frozen=True)
class Done:
    metrics: DecodeMetrics
    tokens: tuple[int, ...]


Event = Tentative | Committed | Rollback | Unverified | Done
