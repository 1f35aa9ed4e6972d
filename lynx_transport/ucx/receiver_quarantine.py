"""Tag tokens, and the quarantine of a failed stream's receives, pool blocks and token.

Owned by the receiver's I/O thread (:mod:`lynx_transport.ucx.receiver_loop`).

A failed stream's UCX receives stay posted, and its pool blocks stay taken,
:data:`QUARANTINE_S` before the receives are cancelled (explicitly) and the
blocks reused (once every receive has finished): a receive that was matched
mid-transfer finishes (or errors) first. Cancelling a matched receive while
its dead peer's transfer was unwinding crashed UCX in testing. The token stays
taken as long, so no new stream's tags can match those receives.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

from lynx_transport.errors import TransportError
from lynx_transport.protocol.pool import ReceivePool

__all__ = ["Quarantine", "QUARANTINE_S"]

#: How long a failed stream's receives stay posted and its pool blocks taken.
QUARANTINE_S = 0.2

#: A quarantine whose receives have not all finished is looked at again this soon.
RECHECK_S = 0.01


class Quarantine:
    """Tokens in use, and failed streams' leftovers waiting until they are safe to reuse.

    ``cancel`` cancels ``(rail, request)`` receives, each on its worker's thread.
    """

    def __init__(self, pool: ReceivePool,
                 cancel: Callable[[Sequence[tuple[int, Any]]], None]) -> None:
        self._pool = pool
        self._cancel = cancel
        self._tokens: set[int] = set()
        # (until, pool blocks, (rail, request) receives, token)
        self._held: list[tuple[float, list[tuple[int, int]], list[tuple[int, Any]], int]] = []

    def alloc_token(self) -> int:
        """A random 32-bit tag token, not in use (not guessable by another UCX peer)."""
        for _ in range(1000):
            token = secrets.randbits(32)
            if token and token not in self._tokens:
                self._tokens.add(token)
                return token
        raise TransportError("no free stream token")

    def free_token(self, token: int) -> None:
        """A completed stream's token: every receive finished, it can be reused at once."""
        self._tokens.discard(token)

    def hold(self, now: float, blocks: list[tuple[int, int]], requests: list[tuple[int, Any]],
             token: int) -> None:
        """Quarantine a failed stream's pool ``blocks``, posted ``requests`` and ``token``."""
        self._held.append((now + QUARANTINE_S, blocks, requests, token))

    def sweep(self, now: float) -> float | None:
        """Free what is due; returns when to look again (``None``: nothing held)."""
        deadline: float | None = None
        keep = []
        for entry in self._held:
            until, blocks, requests, token = entry
            if until <= now:
                # cancel explicitly, and reuse the blocks only once every receive
                # has finished: no late message can land in another stream's bytes
                self._cancel(requests)
                if all(req.completed for _, req in requests):
                    requests.clear()
                    self._tokens.discard(token)
                    for off, n in blocks:
                        self._pool.release(off, n)
                    continue
                until = now + RECHECK_S
            keep.append(entry)
            deadline = until if deadline is None else min(deadline, until)
        self._held = keep
        return deadline

    def release_all(self) -> None:
        """Shutting down: drop every held receive (the worker goes too) and free the blocks."""
        for _, blocks, requests, _ in self._held:
            requests.clear()
            for off, n in blocks:
                self._pool.release(off, n)
        self._held = []

    def drop_requests(self) -> None:
        """The I/O thread's last act: drop every UCX request still referenced here."""
        self._held = []
