"""Running a peer in a child process: :class:`PeerProcess` and :class:`PeerFailed`.

A :class:`PeerProcess` runs a ``target(pipe, *args)`` in a ``spawn``-ed child that
speaks a request/response protocol over a pipe (replies ``("ok", value)``), and
forwards every exception's full traceback to the parent (as :class:`PeerFailed`),
so a failure in the child is never a silent hang. Re-exported by
:mod:`lynx_transport.testing`, whose ``sender_server`` and ``receiver_server`` are
such targets.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from typing import Any

__all__ = ["PeerFailed", "PeerProcess"]


class PeerFailed(AssertionError):
    """The child raised; the message carries its traceback."""


def _child(target: Any, conn: multiprocessing.connection.Connection, args: tuple) -> None:
    # SIGUSR1 writes every thread's stack to stderr: the parent asks for it when a reply is late
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        target(conn, *args)
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the parent may be gone
            pass


class PeerProcess:
    """A child process speaking a request/response protocol over a pipe."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(target, child, args), daemon=True)
        self.process.start()
        child.close()

    def call(self, *request: Any, timeout: float = 60.0) -> Any:
        """Send a request, wait (at most ``timeout`` s) for the reply, forward child errors."""
        self._conn.send(request)
        return self.reply(timeout)

    def reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            alive = self.process.is_alive()
            if alive and self.process.pid is not None:
                os.kill(self.process.pid, signal.SIGUSR1)  # its threads' stacks, on its stderr
                time.sleep(1.0)
            where = "; the stacks of its threads are on its stderr" if alive else ""
            raise PeerFailed(f"no reply from the child within {timeout} s (alive={alive}{where})")
        kind, value = self._conn.recv()
        if kind == "error":
            raise PeerFailed(f"the child process failed:\n{value}")
        return value

    def kill(self) -> None:
        """SIGKILL the child (a crash, as far as its peers can tell)."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the child (e.g. ``SIGSTOP`` to make it silent without closing)."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signum)

    def close(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit",))
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
