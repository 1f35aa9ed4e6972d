"""Heartbeats from a thread that does nothing else.

An I/O thread can be late for many reasons that are not death: it is posting a
stream's receives, checksumming chunks, or simply waiting for a core on a busy host.
If its heartbeats waited for it, a peer would count that lateness as silence. So each
I/O loop that owns control sockets has one :class:`Heartbeats` thread: every
``interval_s`` it sends a HEARTBEAT on each registered socket that said nothing for
that long (:meth:`ControlSocket.heartbeat_if_due`, which serialises with the I/O
thread's own writes). It never reads and never decides that a peer is dead: that stays
with the I/O thread (:meth:`ControlSocket.keep_alive`), which also counts any byte
waiting in the socket as a sign of life.
"""

from __future__ import annotations

import threading

from lynx_transport.protocol.clock import Clock
from lynx_transport.ucx.control import ControlSocket

__all__ = ["Heartbeats"]


class Heartbeats:
    """A daemon thread that keeps the registered control sockets talking.

    ``add``/``discard`` may be called from any thread; ``stop`` ends the thread
    (idempotent) and waits for it at most ``timeout`` seconds.
    """

    def __init__(self, name: str, clock: Clock, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._clock = clock
        self._interval_s = interval_s
        self._sockets: set[ControlSocket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def add(self, ctl: ControlSocket) -> None:
        with self._lock:
            self._sockets.add(ctl)

    def discard(self, ctl: ControlSocket) -> None:
        with self._lock:
            self._sockets.discard(ctl)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._started and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s / 2):
            with self._lock:
                sockets = list(self._sockets)
            now = self._clock.now()
            for ctl in sockets:
                ctl.heartbeat_if_due(now, self._interval_s)
