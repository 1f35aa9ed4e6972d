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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from lynx_transport.errors import TransportError
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.manifest import Manifest
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.wire import chunk_tag, rail_of
from lynx_transport.receive_stream import ReceivedRegion
from lynx_transport.ucx import adapter
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.loop import IoLoop
from lynx_transport.ucx.receiver_state import PostedChunk, RxStream

__all__ = ["RailLoop", "post_receives", "post_drain", "cancel_receives"]


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


def _chunks(manifest: Manifest, n_rails: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """``(region, offset, nbytes, index, lane, rail)`` of every chunk of ``manifest``,
    region by region: chunk ``i`` travels on rail ``i % n_rails`` (the sender picks the same)."""
    cb = manifest.chunk_bytes
    for i, (r, first) in enumerate(zip(manifest.regions, manifest.first_chunk_indices())):
        for k, off in enumerate(range(0, r.nbytes, cb)):
            index = first + k
            yield i, off, min(cb, r.nbytes - off), index, r.lane, rail_of(index, n_rails)


def _post(worker: UcxWorker, rails: Sequence[RailLoop], receives: Sequence[tuple[int, Any, int]],
          requests: list[Any]) -> None:
    """Post ``(rail, view, tag)`` receives, rail 0 on ``worker`` (this thread), the others on
    their own threads, each request into ``requests`` at its index (``None`` where not
    posted). ``TransportError`` if UCX refuses."""
    handed: list[list[int]] = [[] for _ in rails]
    for k, (rail, view, tag) in enumerate(receives):
        if rail:
            handed[rail - 1].append(k)
            continue
        try:
            requests[k] = worker.tag_recv(view, tag)
        except Exception as exc:
            raise TransportError(f"cannot post a UCX receive: {exc}") from exc
    for loop, ks in zip(rails, handed):
        if not ks:
            continue
        batch = [(receives[k][1], receives[k][2]) for k in ks]
        try:
            got = loop.run(functools.partial(loop.post, batch), 5.0)
        except Exception as exc:
            raise TransportError(f"cannot post UCX receives on a receive rail: {exc}") from exc
        for k, req in zip(ks, got):
            requests[k] = req


def post_receives(worker: UcxWorker, rails: Sequence[RailLoop], pool: ReceivePool, rx: RxStream,
                  manifest: Manifest, regions: Sequence[ReceivedRegion]) -> None:
    """Post one tagged receive per chunk of a stream into its pool regions (on the I/O
    thread, whose ``worker`` is rail 0). Fills ``rx.pending``; ``TransportError`` if UCX refuses."""
    chunks = [PostedChunk(None, i, off, n, index, lane, rail)
              for i, off, n, index, lane, rail in _chunks(manifest, 1 + len(rails))]
    receives = [(p.rail, pool.view(regions[p.region].offset + p.offset, p.nbytes),
                 chunk_tag(rx.token, p.index)) for p in chunks]
    for p in chunks:
        rx.pending[p.lane].append(p)
    requests: list[Any] = [None] * len(receives)
    try:
        _post(worker, rails, receives, requests)
    finally:  # those posted before a failure are cancelled with the failed stream
        for p, req in zip(chunks, requests):
            p.request = req


def post_drain(worker: UcxWorker, rails: Sequence[RailLoop], manifest: Manifest,
               token: int) -> tuple[list[tuple[int, Any]], Any]:
    """Receive every chunk of a refused stream whose sender did not wait for ACCEPT
    (``OPEN_SENT``) into one scratch buffer, so its sends finish and nothing stays in UCX;
    ``((rail, request) receives, the scratch)``."""
    chunks = list(_chunks(manifest, 1 + len(rails)))
    scratch = np.empty(max((c[2] for c in chunks), default=1), np.uint8)
    receives = [(rail, scratch[:n], chunk_tag(token, index)) for _, _, n, index, _, rail in chunks]
    requests: list[Any] = [None] * len(receives)
    try:
        _post(worker, rails, receives, requests)
    except TransportError:
        pass  # a chunk left unreceived stays in UCX: its worker is parked at close (adapter)
    return [(rail, req) for (rail, _, _), req in zip(receives, requests) if req is not None], scratch


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
