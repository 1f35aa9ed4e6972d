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

from collections.abc import Callable, Sequence
from typing import Any

from lynx_transport import _ucx
from lynx_transport._loop import IoLoop
from lynx_transport.clock import Clock

__all__ = ["RailLoop"]


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
            _ucx.cancel(request)

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
