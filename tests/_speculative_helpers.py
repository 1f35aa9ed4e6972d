"""Helpers shared by the engine's unit tests (toy model) and its real-model tests."""

from __future__ import annotations

import concurrent.futures as cf

from lynx_decode.model import KVBuffers


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
