"""Mooncake Transfer Engine as a baseline of ``lynx bench-transport``: a target and an initiator.

Each process makes a ``TransferEngine`` initialised peer-to-peer, without a
metadata server (``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``) and
registers host memory (``register_memory``); the initiator names the target as
``"127.0.0.1:<its get_rpc_port()>"`` and each message is one
``transfer_sync_write`` of its buffer into the target's (returns once the bytes
are in the target's memory). A message's time is that call's.

The ``non-cuda`` wheel has no shared-memory transport, so Mooncake runs over
TCP only: it is compared with Lynx over ``UCX_TLS=tcp`` (``lynx_tcp_gbps``).
Its best documented configuration for host memory on one machine is this one:
the target needs no polling (the engine's own threads serve it). The initiator
sends from a never-written buffer, like Lynx's (see
:mod:`lynx_bench.transport_bench.cli`), or from a written one; the target's buffer is
written.
"""

from __future__ import annotations

import importlib
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

from lynx_bench.transport_bench.peers.engines import ENGINES, Engine, import_error, serve, timed_writes
from lynx_transport.testing import PeerProcess

__all__ = ["MooncakePair", "mooncake_target", "mooncake_initiator", "CONFIG"]

#: What the JSON says about the configuration measured.
CONFIG = "P2PHANDSHAKE (no metadata server), protocol tcp, transfer_sync_write"


def _engine(nbytes: int, touch: bool) -> tuple[Any, Any, int]:
    """An initialised engine with ``nbytes`` of registered host memory; (engine, buffer, address)."""
    # an optional peer engine, loaded in its own process only
    TransferEngine = importlib.import_module(ENGINES[Engine.MOONCAKE].module).TransferEngine
    from lynx_transport.protocol.pool import host_buffer  # noqa: PLC0415

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    buf = host_buffer(nbytes, touch=touch)
    address = int(buf.ctypes.data)
    if engine.register_memory(address, nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    return engine, buf, address


def mooncake_target(pipe: Pipe, nbytes: int) -> None:
    """Child: the target's engine and memory; idle until ``("exit",)``."""
    try:
        engine, _buf, address = _engine(nbytes, touch=True)
    except ImportError as exc:
        pipe.send(("ok", {"unavailable": import_error(Engine.MOONCAKE, exc)}))
        return
    pipe.send(("ok", {"session": f"127.0.0.1:{engine.get_rpc_port()}", "address": address}))
    while pipe.recv()[0] != "exit":
        pipe.send(("ok", None))


def mooncake_initiator(pipe: Pipe, nbytes: int) -> None:
    """Child: the initiator. Requests: ``("connect", session, address)``,
    ``("timed", size, messages, warm_up_s, written)`` -> seconds per timed message."""
    try:
        engine, _buf, address = _engine(nbytes, touch=False)
    except ImportError as exc:
        pipe.send(("ok", {"unavailable": import_error(Engine.MOONCAKE, exc)}))
        return
    from lynx_transport.protocol.pool import host_buffer  # noqa: PLC0415 - after _engine, like there

    written = host_buffer(nbytes, touch=True)  # the *_written groups: what real data gets
    sources = {False: address, True: int(written.ctypes.data)}
    if engine.register_memory(sources[True], nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    pipe.send(("ok", {}))
    session = ""
    remote_address = 0

    def write(size: int, from_written: bool) -> float:
        start = time.perf_counter()
        if engine.transfer_sync_write(session, sources[from_written], remote_address, size) != 0:
            raise RuntimeError(f"Mooncake transfer_sync_write of {size} B to {session} failed")
        return time.perf_counter() - start

    def connect(target: str, address: int) -> str:
        nonlocal session, remote_address
        session, remote_address = target, int(address)
        return session

    serve(pipe, {"connect": connect, "timed": timed_writes(write)})


class MooncakePair:
    """Parent side: the two processes."""

    def __init__(self, nbytes: int) -> None:
        self.target = PeerProcess(mooncake_target, nbytes)
        self.initiator = PeerProcess(mooncake_initiator, nbytes)

    def connect(self, timeout: float = 120.0) -> str | None:
        """Wait for both children and hand the initiator the target; the skip reason if
        Mooncake cannot run."""
        target, initiator = self.target.reply(timeout), self.initiator.reply(timeout)
        for side in (target, initiator):
            if "unavailable" in side:
                return str(side["unavailable"])
        self.initiator.call("connect", target["session"], target["address"], timeout=timeout)
        return None

    def timed(self, size: int, messages: int, warm_up_s: float, written: bool = False) -> list[float]:
        """Seconds per message for ``messages`` writes of ``size`` bytes (after the warm-up),
        from the never-written buffer or (``written``) a written one."""
        return list(self.initiator.call("timed", size, messages, warm_up_s, written, timeout=300.0))

    def close(self) -> None:
        self.initiator.close()
        self.target.close()
