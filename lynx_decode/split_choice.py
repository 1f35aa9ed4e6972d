"""``--anchor-bits auto``: the plane split chosen for the link and the context.

Pure logic (no clock, no I/O). The inputs are what the decode node knows before
it asks: the bytes of the prompt's cache at INT8 (from the model's shape and the
prompt length), the link rate (requested, or measured on earlier streams) and
the time of one decode step at this context (measured on earlier runs).

The rule, with ``T`` the INT8 cache's transfer time and ``S`` one decode step:

- ``T < 3 S``: no split (INT8). A ``4,4`` draft is tentative once its anchors
  are in (``T / 2``) and its compute is through, and committed only after a
  verify pass over the drafts (1.5-2.5 steps, docs/design.md): ``T / 2 + 1.5 S``
  comes by INT8's ``T`` within 5 % only from ``T = 2.7 S``, and a first pass
  that waits for the exact K/V instead starts its layers only as the residual
  lands, in the second half of ``T``, so it falls behind INT8's pipelined pass
  once a step is more than ``T / 2``. Below ``3 S`` neither clock gains; INT8
  is as early on both.
- ``3 S <= T < 8 S``: ``4,4``. Tentative tokens at INT4's time, committed ones at
  INT8's (the verify pass rides on the residual's arrival), drafts as good as
  INT4's.
- ``T >= 8 S``: ``3,5``. One anchor bit fewer saves ``T / 8``, at least a step, on
  the tentative clock; the 3-bit anchor's first token is right a little less
  often than the 4-bit anchor's, and the committed clock is unchanged.

Two bits (``2,6`` or ``2,2,4``) are never chosen: the 2-bit anchor agrees with the
fp32 cache on too few tokens for a first token worth showing.

The measurements behind the thresholds: docs/design.md, "Measured facts".
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx_decode.codec.config import DEFAULT_ANCHOR_BITS
from lynx_decode.errors import CodecError

__all__ = ["SplitChoice", "choose_split", "choose_split_or_default", "NO_SPLIT_STEPS", "THREE_BIT_STEPS",
           "DEFAULT_STEP_S"]

#: Below this many decode steps of INT8 transfer, no split.
NO_SPLIT_STEPS = 3.0
#: From this many decode steps of INT8 transfer, a 3-bit anchor.
THREE_BIT_STEPS = 8.0
#: The decode step (seconds) assumed before any was measured; docs/design.md, "Measured facts".
DEFAULT_STEP_S = 0.1


@dataclass(frozen=True)
class SplitChoice:
    """The chosen split (None: no split, decode INT8) and why; ``transfer_s`` and
    ``step_s`` are None for the default chosen with nothing known about the link."""

    planes: tuple[int, ...] | None
    transfer_s: float | None = None
    step_s: float | None = None

    @property
    def reason(self) -> str:
        what = "int8 (no split)" if self.planes is None else "lynx " + ",".join(map(str, self.planes))
        if self.transfer_s is None or self.step_s is None:
            return f"{what}: the default (no link rate requested or seen yet)"
        return (f"{what}: the INT8 cache takes {self.transfer_s * 1e3:.0f} ms on the link, "
                f"{self.transfer_s / self.step_s:.1f} decode steps of {self.step_s * 1e3:.0f} ms")


def choose_split(int8_bytes: int, rate_gbps: float, step_s: float = DEFAULT_STEP_S) -> SplitChoice:
    """The split for a cache of ``int8_bytes`` (its size at INT8) on a link of
    ``rate_gbps`` (decimal Gbit/s) when one decode step takes ``step_s`` seconds.

    Raises :class:`CodecError` unless ``int8_bytes``, ``step_s`` and a finite
    ``rate_gbps`` are all positive."""
    if not int8_bytes > 0:
        raise CodecError(f"int8_bytes must be positive, got {int8_bytes!r}")
    if not (rate_gbps > 0 and rate_gbps != float("inf")):
        raise CodecError(f"the link rate must be a positive number of Gbit/s, got {rate_gbps!r}")
    if not step_s > 0:
        raise CodecError(f"step_s must be positive, got {step_s!r}")
    transfer = int8_bytes * 8 / (rate_gbps * 1e9)
    if transfer < NO_SPLIT_STEPS * step_s:
        planes: tuple[int, ...] | None = None
    elif transfer < THREE_BIT_STEPS * step_s:
        planes = (4, 4)
    else:
        planes = (3, 5)
    return SplitChoice(planes, transfer, step_s)


def choose_split_or_default(int8_bytes: int, rate_gbps: float | None,
                            step_s: float = DEFAULT_STEP_S) -> SplitChoice:
    """:func:`choose_split`, or the default split (``4,4``, no transfer time) when nothing is
    known about the link (``rate_gbps`` None)."""
    if rate_gbps is None:
        return SplitChoice((DEFAULT_ANCHOR_BITS, 8 - DEFAULT_ANCHOR_BITS))
    return choose_split(int8_bytes, rate_gbps, step_s)
