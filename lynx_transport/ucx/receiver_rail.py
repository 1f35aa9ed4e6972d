"""An extra receive rail: one more UCX worker, progressed by its own thread.

The receiver's I/O thread (``lynx-rx-io``) owns every stream and all accounting;
it runs rail 0 itself. Rails 1.. (``TransportConfig.rails``) only post the
receives they are handed (:meth:`RailLoop.post`, run on the rail's thread: a
UCX worker is used by one thread), progress their worker - over ``cma`` that
is where the bytes are copied, so rails copy in parallel - and wake the I/O
thread when one of their receives completes. The I/O thread reads the
requests' completion flags itself, as for rail 0; cancels go back to the
owning rail's thread (:meth:`RailLoop.cancel`), and a rail drops its last
reference to a request only on its own thread.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

from lynx_transport.errors import TransportError
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.manifest import Manifest
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.wire import rail_of
from lynx_transport.receive_stream import ReceivedRegion
from lynx_transport.ucx import adapter
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.loop import IoLoop
from lynx_transport.ucx.receiver_state import PostedChunk, RxStream

__all__ = ["RailLoop", "post_receives", "cancel_receives"]


class RailLoop(IoLoop):
    def __init__(self, index: int, wake_owner: Callable[[], None], tls: str, clock: Clock,
                 thread_init: Callable[[], None] | None, net_devices: str, nice: int) -> None:
        super().__init__(f"lynx-rx-rail{index}", tls, clock, thread_init,
                         net_devices=net_devices, nice=nice)
        self._wake_owner = wake_owner
        self._posted: list[Any] = []

    # -- run on the rail's thread (through ``run``/``call``) ------------------------------
    def post(self, receives: Sequence[tuple[Any, int]]) -> list[Any]:
        """Post ``(view, tag)`` receives; returns their requests in order."""
        requests = [self.worker.tag_recv(view, tag) for view, tag in receives]
        self._posted.extend(requests)
        return requests

    def cancel(self, requests: Sequence[Any]) -> None:
        for request in requests:
            adapter.cancel(request)

    # -- the loop body ----------------------------------------------------------------------
    def step(self) -> tuple[bool, bool, float | None]:
        if not self._posted:
            return False, False, None
        before = len(self._posted)
        self._posted = [r for r in self._posted if not r.completed]
        if len(self._posted) == before:
            return False, True, None
        self._wake_owner()  # the I/O thread accounts the landed chunks
        return True, bool(self._posted), None

    def release_ucx(self) -> None:
        self._posted.clear()


def post_receives(worker: UcxWorker, rails: Sequence[RailLoop], pool: ReceivePool, rx: RxStream,
                  manifest: Manifest, regions: Sequence[ReceivedRegion]) -> None:
    """Post one tagged receive per chunk of a stream into its pool regions (on the I/O
    thread, whose ``worker`` is rail 0): chunk ``i`` on rail ``i % rails``, the rails'
    on their own threads. Fills ``rx.pending``; ``TransportError`` if UCX refuses."""
    cb = manifest.chunk_bytes
    base = rx.token << 32
    n_rails = 1 + len(rails)
    # (pending, view) of the chunks each extra rail posts on its own thread
    handed: list[list[tuple[PostedChunk, Any]]] = [[] for _ in rails]
    for i, (r, first) in enumerate(zip(regions, manifest.first_chunk_indices())):
        q = rx.pending[r.lane]
        for k, off in enumerate(range(0, r.nbytes, cb)):
            n, index = min(cb, r.nbytes - off), first + k
            rail = rail_of(index, n_rails)  # the sender picks the same endpoint
            view = pool.view(r.offset + off, n)
            p = PostedChunk(None, i, off, n, index, r.lane, rail)
            if rail:
                handed[rail - 1].append((p, view))
            else:
                try:
                    p.request = worker.tag_recv(view, base | index)
                except Exception as exc:
                    raise TransportError(f"cannot post a UCX receive: {exc}") from exc
            q.append(p)
    for loop, chunks in zip(rails, handed):
        if not chunks:
            continue
        receives = [(view, base | p.index) for p, view in chunks]
        try:
            requests = loop.run(functools.partial(loop.post, receives), 5.0)
        except Exception as exc:
            raise TransportError(f"cannot post UCX receives on a receive rail: {exc}") from exc
        for (p, _), req in zip(chunks, requests):
            p.request = req


def cancel_receives(requests: Sequence[tuple[int, Any]], rails: Sequence[RailLoop]) -> None:
    """Cancel ``(rail, request)`` receives, each on its worker's own thread (rail 0: this one)."""
    on_rail: dict[int, list[Any]] = collections.defaultdict(list)
    for rail, req in requests:
        if rail == 0:
            adapter.cancel(req)
        elif not req.completed:
            on_rail[rail].append(req)
    for rail, reqs in on_rail.items():
        target = rails[rail - 1]
        target.call(functools.partial(target.cancel, reqs))
