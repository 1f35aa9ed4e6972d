"""The callback thread: user callbacks run here, one at a time, in event order."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from lynx_transport._threads import renice_current_thread

__all__ = ["Dispatcher"]

log = logging.getLogger("lynx_transport")
_STOP = object()


class Dispatcher:
    """Runs posted calls on one dedicated thread; a raising callback is logged, not fatal."""

    def __init__(self, name: str, nice: int = 0) -> None:
        self._nice = nice
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., Any] | None, *args: Any) -> None:
        if fn is not None:
            self._queue.put((fn, args))

    def _run(self) -> None:
        renice_current_thread(self._nice)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:
                log.exception("lynx callback %s raised", getattr(fn, "__name__", fn))

    def stop(self, timeout: float) -> None:
        """Run what is queued, then stop (waits at most ``timeout`` s)."""
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
