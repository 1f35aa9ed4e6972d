"""Test helpers: a real ``lynx serve`` process (the prefill node) for two-process tests.

The child's stderr goes to a temp file whose tail is attached to any failure, so a
crash in the child shows its traceback in the test report.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lynx_bench.processes import Child

__all__ = ["serve_process"]


@contextlib.contextmanager
def serve_process(startup_timeout: float = 300.0) -> Iterator[tuple[Child, tuple[str, int]]]:
    """A ``lynx serve`` child on an ephemeral loopback port; yields (child, address)."""
    log = Path(tempfile.mkstemp(prefix="lynx-serve-", suffix=".log")[1])
    child = Child("lynx serve", [sys.executable, "-m", "lynx_bench.cli", "serve",
                                 "--listen", "127.0.0.1:0"], log)
    try:
        host, port = child.expect("listening on", startup_timeout).rsplit(":", 1)
        yield child, (host, int(port))
    finally:
        child.stop()
        log.unlink(missing_ok=True)
