"""What the decode engine (:mod:`lynx_decode.speculative`) is given and returns:
its configuration (:class:`DecodeConfig`, :class:`MissingFull`), the cache
levels it drafts on and verifies against (:class:`CacheLevel`, :func:`ready`
for a cache at hand), and a finished run (:class:`Generation`).
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
from collections.abc import Callable
from dataclasses import dataclass

from lynx_decode.errors import DecodeError
from lynx_decode.events import DecodeMetrics
from lynx_decode.model.buffers import KVBuffers

__all__ = ["DecodeConfig", "Generation", "MissingFull", "CacheLevel", "DEFAULT_MAX_DRAFT", "ready"]

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
    happens when it is exceeded or the full cache fails. ``step_s`` (None: unknown)
    is the expected time of one decode step, until the first is measured: while a
    pass has read exact K/V in every layer so far, a layer whose exact K/V is not in
    waits for it (at most a step) when the exact level is due within a step."""

    max_new_tokens: int = 32
    max_draft: int = DEFAULT_MAX_DRAFT
    stop_at_eos: bool = True
    wait_timeout_s: float = 600.0
    full_timeout_s: float | None = None
    on_missing_full: MissingFull = MissingFull.FAIL
    step_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise DecodeError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_draft < 0:
            raise DecodeError(f"max_draft must be >= 0, got {self.max_draft}")
        if not self.wait_timeout_s > 0:
            raise DecodeError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        if self.full_timeout_s is not None and not self.full_timeout_s > 0:
            raise DecodeError(f"full_timeout_s must be > 0, got {self.full_timeout_s}")
        if self.step_s is not None and not self.step_s > 0:
            raise DecodeError(f"step_s must be > 0, got {self.step_s}")


@dataclass(frozen=True)
class Generation:
    tokens: tuple[int, ...]
    metrics: DecodeMetrics


def ready(kv: KVBuffers) -> cf.Future[KVBuffers]:
    """A future already resolved with ``kv`` (a cache that is at hand)."""
    future: cf.Future[KVBuffers] = cf.Future()
    future.set_result(kv)
    return future


@dataclass(frozen=True)
class CacheLevel:
    """One cache the engine can run on: ``future`` resolves to it once complete;
    ``buffers`` (optional) are those buffers while they fill, so a pass can start
    before and wait per layer; ``eta`` (optional) estimates the seconds until it
    completes (None: unknown); ``take`` (optional) makes one layer of ``buffers``
    readable if its bytes land within a timeout (``take(i, timeout)`` True: it is;
    the assembler dequantizes a layer it held back, on the calling thread).
    Without ``take`` a layer is readable once ``buffers`` has it written."""

    future: cf.Future[KVBuffers]
    buffers: KVBuffers | None = None
    eta: Callable[[], float | None] | None = None
    take: Callable[[int, float], bool] | None = None
