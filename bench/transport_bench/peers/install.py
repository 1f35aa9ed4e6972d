"""``lynx bench-transport --install-peers``: install the peer engines into this environment.

Runs each engine's pip steps (:data:`lynx_bench.transport_bench.peers.engines.ENGINES`) with this
interpreter's pip: NIXL with ``--no-deps`` plus numpy, because its wheel
declares an unpinned ``torch`` that would pull a CUDA build into Lynx's
environment. Checks afterwards that the installed torch (if any) is the one
found before, and names the Debian packages an engine's libraries still need
(installing them needs root: ``apt-get install -y ...``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

from lynx_bench.transport_bench.peers.engines import ENGINES, Engine, missing

__all__ = ["install_peers"]


def _torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def install_peers(engines: list[Engine]) -> int:
    """Install ``engines``; prints what it runs; 0 on success, 1 otherwise."""
    torch_before = _torch()
    for engine in engines:
        for args in ENGINES[engine].pip:
            command = [sys.executable, "-m", "pip", "install", "-q", *args]
            print(f"lynx bench-transport: {' '.join(command)}", flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                print(f"lynx bench-transport: installing {engine.value} failed", file=sys.stderr)
                return 1
    torch_after = _torch()
    if torch_after != torch_before:
        print(f"lynx bench-transport: torch changed from {torch_before} to {torch_after}; "
              "the peer engines must not replace Lynx's torch", file=sys.stderr)
        return 1
    importlib.invalidate_caches()  # the modules pip just installed
    status = 0
    for engine in engines:
        reason = missing(engine)
        if reason is not None:
            print(f"lynx bench-transport: {reason}", file=sys.stderr)
            status = 1
        else:
            print(f"lynx bench-transport: {engine.value} ready")
    return status
