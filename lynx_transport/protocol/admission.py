"""Pool admission: manifests waiting for receive-pool space, decided in arrival order (no I/O).

A receiver's OPEN frames queue here; :meth:`AdmissionQueue.next` says, one at a
time, what to do with the oldest: admit it (its regions are allocated in the
pool, all at once), refuse it (it cannot fit before its deadline,
``pool_wait_s`` after it arrived, or it is larger than the whole pool), or wait
until a given time (back-pressure: later manifests wait behind it). Acting on a
decision (frames, callbacks) is the caller's: the UCX receiver loop and the
in-memory twin both drive this class. ``P`` is whatever the caller knows a
manifest's sender by.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Generic, TypeVar

from lynx_transport.errors import PoolExhaustedError
from lynx_transport.protocol.manifest import Manifest
from lynx_transport.protocol.pool import ReceivePool

__all__ = ["AdmissionQueue", "Admit", "Refuse", "Wait"]

P = TypeVar("P")


@dataclasses.dataclass(frozen=True)
class Admit(Generic[P]):
    """Open the stream: its regions start at ``offsets`` in the pool (manifest order)."""

    peer: P
    manifest: Manifest
    offsets: list[int]


@dataclasses.dataclass(frozen=True)
class Refuse(Generic[P]):
    """Reject the stream: the pool has no room for it in time (or ever)."""

    peer: P
    manifest: Manifest
    error: PoolExhaustedError


@dataclasses.dataclass(frozen=True)
class Wait:
    """Nothing more to admit before ``until`` (unless pool space is released sooner)."""

    until: float


class AdmissionQueue(Generic[P]):
    """Manifests waiting for pool space, first come first served.

    ``gone(peer)``: True when the peer's entries are to be skipped unseen (its
    connection closed); the default keeps every entry.
    """

    def __init__(self, pool: ReceivePool, wait_s: float,
                 gone: Callable[[P], bool] = lambda peer: False) -> None:
        self.pool = pool
        self.wait_s = wait_s
        self.gone = gone
        self.entries: collections.deque[tuple[float, P, Manifest]] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, peer: P, manifest: Manifest, now: float) -> None:
        """Queue ``manifest``; it may wait until ``now + wait_s``."""
        self.entries.append((now + self.wait_s, peer, manifest))

    def holds(self, peer: P, stream_id: int) -> bool:
        """True when ``peer``'s stream ``stream_id`` is waiting."""
        return any(p is peer and m.stream_id == stream_id for _, p, m in self.entries)

    def discard(self, peer: P, stream_id: int | None = None) -> None:
        """Forget ``peer``'s waiting manifests (only ``stream_id``'s when given)."""
        if any(p is peer for _, p, _ in self.entries):
            self.entries = collections.deque(
                e for e in self.entries
                if not (e[1] is peer and (stream_id is None or e[2].stream_id == stream_id)))

    def clear(self) -> None:
        self.entries.clear()

    def next(self, now: float) -> Admit[P] | Refuse[P] | Wait | None:
        """The decision on the oldest waiting manifest (removed unless ``Wait``); None: empty."""
        while self.entries:
            until, peer, manifest = self.entries[0]
            if self.gone(peer):
                self.entries.popleft()
                continue
            try:
                offsets = self.pool.allocate([r.nbytes for r in manifest.regions])
            except PoolExhaustedError as exc:
                if until > now and manifest.total_bytes <= self.pool.nbytes:
                    return Wait(until)
                self.entries.popleft()
                return Refuse(peer, manifest, exc)
            self.entries.popleft()
            return Admit(peer, manifest, offsets)
        return None
