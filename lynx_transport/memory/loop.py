"""The in-memory network's one thread: runs a step function and the calls handed to it.

:class:`NetLoop` is the concurrency model of :mod:`lynx_transport.memory.transport`
(threads + futures, as :mod:`lynx_transport.ucx.loop`): one thread
(``lynx-mem-net``) owns every bit of state of one ``MemoryTransport`` - its
listeners, its egresses, their connections and both ends of every stream -
and other threads hand it work with :meth:`NetLoop.run` (a future, waited with
a timeout). Between two steps it runs every call handed to it.

The thread runs while its users (open listeners and egresses) need it:
:meth:`NetLoop.acquire` starts it if it is not running, the last
:meth:`NetLoop.release` stops it. While it is not running (nothing is open, or
it crashed) a call runs on the caller's thread, serialised by the loop's lock:
what a stream handle may still do then can only fail or do nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable
from typing import Any

from lynx_transport.errors import TransportError, TransportTimeoutError
from lynx_transport.protocol.clock import Clock, MonotonicClock

__all__ = ["CLOCK", "NetLoop"]

log = logging.getLogger("lynx_transport")
#: The twin's one clock (the streams' timestamps, the shapers, the thread's wake-ups).
CLOCK = MonotonicClock()


class NetLoop:
    """One thread running ``step`` and the calls handed to it (cf. ``ucx.loop.IoLoop``).

    ``step()`` returns ``(progressed, deadline)``: whether it did anything, and
    the clock time it must run again by (``None``: only when work arrives).
    ``crashed(error)`` runs once, under the lock, if a step raises: it fails
    every stream with ``error``; the thread ends and is not started again.
    """

    def __init__(self, name: str, clock: Clock, step: Callable[[], tuple[bool, float | None]],
                 crashed: Callable[[TransportError], None]) -> None:
        self._name, self._clock, self._step, self._crashed = name, clock, step, crashed
        self._cond = threading.Condition()
        self._calls: collections.deque[tuple[Callable[[], Any], cf.Future[Any]]] = collections.deque()
        self._users = 0
        self._thread: threading.Thread | None = None
        self._dead = False  # crashed: every call runs on its caller's thread from now on

    def acquire(self) -> None:
        """One more user: start the thread unless it runs (or crashed)."""
        with self._cond:
            self._users += 1
            if self._thread is None and not self._dead:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def release(self, timeout: float) -> None:
        """One user fewer: the last one stops the thread (waits at most ``timeout`` s)."""
        with self._cond:
            self._users -= 1
            thread = self._thread if self._users == 0 else None
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` on the loop's thread: its result, its exception, or
        :class:`TransportTimeoutError` after ``timeout`` s."""
        fut: cf.Future[Any] = cf.Future()
        with self._cond:
            if self._thread is None or threading.current_thread() is self._thread:
                _run_one(fn, fut)
            else:
                self._calls.append((fn, fut))
                self._cond.notify()
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            raise TransportTimeoutError(
                f"the {self._name} thread did not answer in {timeout} s") from None

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    calls, self._calls = self._calls, collections.deque()
                    if not calls and self._users == 0:
                        self._thread = None  # under the lock: later calls run inline
                        return
                for fn, fut in calls:
                    _run_one(fn, fut)
                progressed, deadline = self._step()
                with self._cond:
                    if not (progressed or calls or self._calls or self._users == 0):
                        self._cond.wait(None if deadline is None
                                        else max(0.0, deadline - self._clock.now()))
        except BaseException as exc:  # fails every stream, then ends the thread
            log.exception("lynx memory-transport thread crashed")
            with self._cond:
                self._crashed(TransportError(f"the memory transport's thread crashed: {exc!r}"))
                for fn, fut in self._calls:
                    _run_one(fn, fut)
                self._calls.clear()
                self._dead = True
                self._thread = None


def _run_one(fn: Callable[[], Any], fut: cf.Future[Any]) -> None:
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
        fut.set_exception(exc)
