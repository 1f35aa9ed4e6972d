"""Connection keys and tag tokens, and the quarantine of a failed stream's receives, pool
blocks and token.

Owned by the receiver's I/O thread (:mod:`lynx_transport.ucx.receiver_loop`).

A failed stream's UCX receives stay posted, and its pool blocks stay taken,
:data:`QUARANTINE_S` before the receives are cancelled (explicitly) and the
blocks reused (once every receive has finished): a receive that was matched
mid-transfer finishes (or errors) first. Cancelling a matched receive while
its dead peer's transfer was unwinding crashed UCX in testing. The token stays
taken as long, so no new stream's tags can match those receives, and so does its
connection's key (a token is the key and the stream id, :func:`~lynx_transport.protocol.wire.stream_token`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

from lynx_transport.errors import ProtocolError, TransportError
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.wire import CONN_KEY_BITS, conn_key_of

__all__ = ["Quarantine", "QUARANTINE_S"]

#: How long a failed stream's receives stay posted and its pool blocks taken.
QUARANTINE_S = 0.2

#: A quarantine whose receives have not all finished is looked at again this soon.
RECHECK_S = 0.01


class Quarantine:
    """Keys and tokens in use, and failed streams' leftovers waiting until they are safe to reuse.

    ``cancel`` cancels ``(rail, request)`` receives, each on its worker's thread.
    """

    def __init__(self, pool: ReceivePool,
                 cancel: Callable[[Sequence[tuple[int, Any]]], None]) -> None:
        self._pool = pool
        self._cancel = cancel
        self._tokens: set[int] = set()
        self._keys: set[int] = set()
        # (until, pool blocks, (rail, request) receives, token, what the receives write into)
        self._held: list[tuple[float, list[tuple[int, int]], list[tuple[int, Any]], int, Any]] = []

    def alloc_key(self) -> int:
        """A random connection key, not a live connection's and not in a held token (so
        not guessable by another UCX peer, and no new tag matches an old receive)."""
        held = {conn_key_of(token) for token in self._tokens}
        for _ in range(1000):
            key = secrets.randbits(CONN_KEY_BITS)
            if key and key not in self._keys and key not in held:
                self._keys.add(key)
                return key
        raise TransportError("no free connection key")

    def free_key(self, key: int) -> None:
        """A dropped connection's key (its held tokens keep it out of reuse)."""
        self._keys.discard(key)

    def take_token(self, token: int) -> None:
        """Mark a new stream's token taken; ``ProtocolError`` if a live or held stream has it
        (a stream id 2**20 ids after a stream that is still live: its tags would collide)."""
        if token in self._tokens:
            raise ProtocolError(f"stream token {token:#x} is still in use by an earlier stream")
        self._tokens.add(token)

    def in_use(self, token: int) -> bool:
        return token in self._tokens

    def free_token(self, token: int) -> None:
        """A completed stream's token: every receive finished, it can be reused at once."""
        self._tokens.discard(token)

    def hold(self, now: float, blocks: list[tuple[int, int]], requests: list[tuple[int, Any]],
             token: int, keep: Any = None) -> None:
        """Quarantine a failed stream's pool ``blocks``, posted ``requests`` and ``token``
        (``keep``: memory the receives write into, held as long)."""
        self._held.append((now + QUARANTINE_S, blocks, requests, token, keep))

    def sweep(self, now: float) -> float | None:
        """Free what is due; returns when to look again (``None``: nothing held)."""
        deadline: float | None = None
        keep = []
        for entry in self._held:
            until, blocks, requests, token, _ = entry
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
        for _, blocks, requests, _, _ in self._held:
            requests.clear()
            for off, n in blocks:
                self._pool.release(off, n)
        self._held = []

    def drop_requests(self) -> None:
        """The I/O thread's last act: drop every UCX request still referenced here."""
        self._held = []
