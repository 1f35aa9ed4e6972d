"""The field's KV transfer engines that ``lynx bench-transport`` measures Lynx against.

Each peer engine is optional: :data:`ENGINES` says which Python module it needs,
how to install it without touching Lynx's environment (NIXL's wheel declares an
unpinned ``torch`` and would pull a CUDA build: it is installed with
``--no-deps`` plus numpy, the one dependency it imports) and which Debian
packages its shared libraries load. :func:`missing` tells why an engine cannot
run here, with the install hint; the benchmark reports such an engine as
skipped with that hint, never drops it silently.

Every engine runs as two child processes of the benchmark (a target that owns
the receive memory and an initiator that writes into it), so no engine's UCX
build is ever loaded next to ucxx's in one process. The children time their
messages with :func:`timed`, the rule every backend of the benchmark follows.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import enum
import importlib.util
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["Engine", "PeerEngine", "ENGINES", "missing", "install_hint", "timed", "WARM_UP_S",
           "import_error"]

#: Seconds of sends each timed group of messages is preceded by (this VM speeds
#: up over ~50 ms of steady traffic; see :mod:`lynx_bench.transport_bench.cli`).
WARM_UP_S = 0.1

T = TypeVar("T")


class Engine(enum.Enum):
    NIXL = "nixl"
    MOONCAKE = "mooncake"


@dataclasses.dataclass(frozen=True)
class PeerEngine:
    """How to find and install one engine."""

    engine: Engine
    module: str                              # what the children import
    pip: tuple[tuple[str, ...], ...]         # pip install argument lists, run in order
    debian: tuple[str, ...] = ()             # shared libraries the wheel loads (apt-get install -y ...)
    libraries: tuple[str, ...] = ()          # ctypes.util.find_library names of those

    @property
    def commands(self) -> list[str]:
        """The shell commands that install it into the current environment."""
        out = [f"apt-get install -y {' '.join(self.debian)}"] if self.debian else []
        return out + [f"python -m pip install {' '.join(args)}" for args in self.pip]


ENGINES: dict[Engine, PeerEngine] = {
    Engine.NIXL: PeerEngine(
        Engine.NIXL, "nixl_cu12",
        # its metadata requires torch (unpinned: a CUDA build); it imports it for type hints only
        pip=(("--no-deps", "nixl-cu12==1.5.1"), ("numpy",))),
    Engine.MOONCAKE: PeerEngine(
        Engine.MOONCAKE, "mooncake.engine",
        pip=(("mooncake-transfer-engine-non-cuda==0.3.13.post1",),),
        debian=("libibverbs1", "libnl-3-200", "libnl-route-3-200"),
        libraries=("ibverbs", "nl-3", "nl-route-3")),
}


def install_hint(engine: Engine) -> str:
    """One line a user can act on: ``lynx bench-transport --install-peers`` or the commands."""
    spec = ENGINES[engine]
    return ("install it with `lynx bench-transport --install-peers` (" + "; ".join(spec.commands) + ")")


def missing(engine: Engine) -> str | None:
    """Why ``engine`` cannot run in this environment (with the install hint), or None.

    Looks for the module and the shared libraries only; the import itself happens
    in the engine's child processes (:func:`import_error` there)."""
    spec = ENGINES[engine]
    top = spec.module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return f"{engine.value}: module {top} is not installed; {install_hint(engine)}"
    absent = [lib for lib in spec.libraries if ctypes.util.find_library(lib) is None]
    if absent:
        return (f"{engine.value}: shared libraries {', '.join('lib' + a for a in absent)} are missing "
                f"(Debian: apt-get install -y {' '.join(spec.debian)}); {install_hint(engine)}")
    return None


def import_error(engine: Engine, exc: BaseException) -> str:
    """The skip reason for an engine whose import failed in its child."""
    return f"{engine.value}: importing {ENGINES[engine].module} failed ({exc}); {install_hint(engine)}"


#: What a request handler of :func:`serve` returns when it sent its own answer.
ANSWERED = object()


def serve(pipe: Any, handlers: Mapping[str, Callable[..., Any]]) -> None:
    """A peer child's request loop: answer each ``(op, *args)`` from the parent with
    ``("ok", handlers[op](*args))`` (unless the handler answered itself and returned
    :data:`ANSWERED`) until ``("exit",)``."""
    while True:
        op, *args = pipe.recv()
        if op == "exit":
            return
        if op not in handlers:
            raise ValueError(f"unknown request {op!r}")
        result = handlers[op](*args)
        if result is not ANSWERED:
            pipe.send(("ok", result))


def timed_writes(write: Callable[[int, bool], float]) -> Callable[[int, int, float, bool], list[float]]:
    """The ``("timed", size, messages, warm_up_s, from_written)`` handler of an initiator whose
    ``write(size, from_written)`` times one message."""
    def handler(size: int, messages: int, warm_up_s: float, from_written: bool) -> list[float]:
        return timed(lambda: write(size, from_written), messages, warm_up_s)
    return handler


def timed(send: Callable[[], T], messages: int, warm_up_s: float = WARM_UP_S) -> list[T]:
    """``send()`` for ``warm_up_s`` (at least once), then the results of ``messages`` more."""
    end = time.perf_counter() + warm_up_s
    send()
    while time.perf_counter() < end:
        send()
    return [send() for _ in range(messages)]
