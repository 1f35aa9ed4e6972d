"""Child processes of the sweep: started with their output read line by line on a
thread, so the driver can wait for a line with a timeout and never hangs on a
child that died. stderr goes to a log file; a child that exits early raises
:class:`ChildError` with the end of that log.

Every child runs with ``PYTHONSAFEPATH=1``: a ``python -m`` started in the checkout
would otherwise put the working directory first on ``sys.path``, where ``kernels/``
hides the PyPI package ``kernels`` that transformers imports (see the README)."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lynx_transport.errors import LynxError

__all__ = ["Child", "ChildError"]


class ChildError(LynxError):
    """A sweep child process died or did not answer in time."""


class Child:
    """A child process whose stdout lines arrive on a queue."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *,
                 env: dict[str, str] | None = None,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}
        self.proc = popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=self._log, env=full_env, text=True, bufsize=1)
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        """The rest of the next stdout line starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{self.name} printed no {prefix!r} line within {timeout:.0f} s"
                                 f"{self._tail()}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait()
                raise ChildError(f"{self.name} exited with code {self.proc.returncode}"
                                 f"{self._tail()}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise ChildError(f"{self.name} is gone{self._tail()}") from None

    def _tail(self, n: int = 15) -> str:
        self._log.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return ("; last lines of " + str(self.log_path) + ":\n  " + "\n  ".join(lines)) if lines else ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log.close()
