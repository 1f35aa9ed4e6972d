"""The ``lynx`` command in a fresh interpreter, as a user runs it (``python -m
lynx_bench.cli``), and which heavy modules it imported before it exited.

What a test of a refusal asserts is its cause: the exit code, the message, and that
the model was never loaded: a run that never imported torch cannot have loaded a
model, however slow the machine it ran on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["HEAVY", "LynxRun", "run_lynx"]

#: What loading a model imports (the CLI imports none of it before it needs a model).
HEAVY = ("torch", "transformers")

# `python -m lynx_bench.cli`, plus a note at exit of which HEAVY modules were imported.
_MAIN = """\
import atexit, json, os, runpy, sys
def _report(path=os.environ.pop("LYNX_TEST_IMPORTS"), heavy=HEAVY):
    with open(path, "w") as fh:
        json.dump(sorted(m for m in heavy if m in sys.modules), fh)
atexit.register(_report)
runpy.run_module("lynx_bench.cli", run_name="__main__", alter_sys=True)
"""


@dataclasses.dataclass(frozen=True)
class LynxRun:
    proc: subprocess.CompletedProcess[str]
    seconds: float  # wall time, start of the interpreter to its exit
    imported: frozenset[str]  # the HEAVY modules the run imported

    @property
    def returncode(self) -> int:
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return self.proc.stdout

    @property
    def stderr(self) -> str:
        return self.proc.stderr


def run_lynx(*argv: str, timeout: float = 120) -> LynxRun:
    """Run ``lynx ARGV`` in a fresh interpreter (stdin closed, output captured)."""
    fd, report = tempfile.mkstemp(prefix="lynx-imports-", suffix=".json")
    os.close(fd)
    try:
        env = {**os.environ, "LYNX_TEST_IMPORTS": report}
        code = f"HEAVY = {HEAVY!r}\n{_MAIN}"
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code, *argv], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, env=env, check=False)
        seconds = time.monotonic() - start
        text = Path(report).read_text()
        assert text, f"lynx {' '.join(argv)} did not report its imports at exit:\n{proc.stderr[-2000:]}"
        return LynxRun(proc, seconds, frozenset(json.loads(text)))
    finally:
        Path(report).unlink(missing_ok=True)
