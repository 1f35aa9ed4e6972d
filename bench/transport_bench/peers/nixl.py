"""NIXL (``nixl-cu12``) as a baseline of ``lynx bench-transport``: a target and an initiator.

The way vLLM's NixlConnector and Dynamo move KV blocks: each process makes a
``nixl_agent`` with the UCX backend, registers host (DRAM) memory, and the
initiator loads the target's metadata (``get_agent_metadata`` /
``add_remote_agent``, exchanged here through the benchmark's pipes); each
message is one ``WRITE`` of the initiator's buffer into the target's
(``initialize_xfer`` once per size, then ``transfer`` and polling
``check_xfer_state`` until ``DONE``: the bytes are in the target's memory).
A message's time is the initiator's, from ``transfer`` to ``DONE``, without a
notification to the target (:data:`NOTIFICATION`: the faster way, by far).
:meth:`NixlPair.notified` times the other way, the one a consumer that must learn of
the bytes uses: each write carries a notification, and a message's time runs from
the initiator's ``transfer`` to the target's ``get_new_notifs`` returning it (both
``time.monotonic()``, one clock for the host's processes; the target busy-polls).

Two documented configurations, both measured:

* ``progress_thread`` - NIXL's progress thread on (its default), the target idle;
* ``polling`` - no progress thread, the target busy-polling its agent
  (``get_new_notifs``) while transfers run: NIXL's transfers hang if the target
  stops calling into it, so the target polls only during its own timed groups
  (``poll`` ... ``stop``) and leaves the cores to the other backends otherwise.

``UCX_TLS`` and ``UCX_NET_DEVICES=lo`` are set in each child before NIXL (and
its bundled UCX) load, the same path as Lynx's and raw ucxx's. The initiator
sends from a never-written buffer, like ``lynx_gbps`` (see
:mod:`lynx_bench.transport_bench.cli`), or from a written one, like
``lynx_written_gbps``; the target's buffer is written (pre-faulted).
"""

from __future__ import annotations

import enum
import importlib
import os
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

from lynx_bench.transport_bench.peers.engines import (
    ANSWERED,
    ENGINES,
    Engine,
    import_error,
    serve,
    timed,
    timed_writes,
)
from lynx_transport.testing import PeerProcess

__all__ = ["NixlConfig", "NixlPair", "nixl_target", "nixl_initiator"]


#: The notification sent with each write: none. With one (``notif_msg``), a write
#: was DONE only once NIXL had sent it over its tcp lane, and that took 8-32 ms (in
#: whole 4 ms ticks) per message here, against 4 us for a 64 KiB write without
#: (measured, both configurations): the benchmark measures NIXL's data path, and
#: its target is not told (Lynx's receiver is: STREAM_DONE is in Lynx's times).
NOTIFICATION = b""


class NixlConfig(enum.Enum):
    """The two configurations measured (values are what the JSON names them)."""

    PROGRESS_THREAD = "progress_thread"
    POLLING = "polling"

    @property
    def described(self) -> str:
        return {NixlConfig.PROGRESS_THREAD: "NIXL's progress thread on (its default), the target idle",
                NixlConfig.POLLING: "no progress thread, the target busy-polling get_new_notifs"}[self]


def _agent(name: str, tls: str, config: NixlConfig, nbytes: int, touch: bool,
           ucx_env: dict[str, str]) -> tuple[Any, Any, int]:
    """A UCX-backed agent with ``nbytes`` of registered DRAM; (agent, buffer, address).

    ``ucx_env``: the ``UCX_*`` variables the benchmark was started with. This child
    inherited the benchmark's environment after ucxx's import had added its own
    (``UCX_RNDV_THRESH``, ``UCX_MAX_RNDV_RAILS``, ``UCX_RNDV_FRAG_MEM_TYPE=cuda``, ...),
    which NIXL's UCX never gets in a NIXL user's process; with them a 64 KiB write took
    ~20 ms instead of ~20 us (measured). They are replaced by ``ucx_env`` first."""
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        del os.environ[key]  # a child process of the benchmark: set before UCX loads
    os.environ.update(ucx_env)
    os.environ["UCX_TLS"] = tls
    os.environ["UCX_NET_DEVICES"] = "lo"
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines would fill the table
    # an optional peer engine, loaded in its own process only
    nixl_cu12 = importlib.import_module(ENGINES[Engine.NIXL].module)
    from lynx_transport.protocol.pool import host_buffer  # noqa: PLC0415

    agent = nixl_cu12.nixl_agent(name, nixl_cu12.nixl_agent_config(
        enable_prog_thread=config == NixlConfig.PROGRESS_THREAD, backends=["UCX"]))
    buf = host_buffer(nbytes, touch=touch)
    address = int(buf.ctypes.data)
    agent.register_memory([(address, nbytes, 0, "")], "DRAM")
    return agent, buf, address


def nixl_target(pipe: Pipe, nbytes: int, tls: str, config: NixlConfig, ucx_env: dict[str, str]) -> None:
    """Child: the target's agent and memory. Requests: ``("connect", metadata)``,
    ``("poll",)`` (busy-poll until the next request, then answer it), ``("stop",)``."""
    try:
        agent, _buf, address = _agent("lynx-bench-target", tls, config, nbytes, True, ucx_env)
    except ImportError as exc:
        pipe.send(("ok", {"unavailable": import_error(Engine.NIXL, exc)}))
        return
    pipe.send(("ok", {"metadata": agent.get_agent_metadata(), "address": address}))
    notifs = 0
    arrived: dict[bytes, float] = {}  # notification -> time.monotonic() it was seen

    def drain() -> None:
        nonlocal notifs
        got = agent.get_new_notifs()
        now = time.monotonic()
        for messages in got.values():
            notifs += len(messages)
            arrived.update((m, now) for m in messages)

    def poll() -> object:
        """Busy-poll (the no-progress-thread configuration) until the parent's next request."""
        pipe.send(("ok", "polling"))
        while not pipe.poll(0):
            for _ in range(64):
                drain()
        return ANSWERED  # the request that ended the polling is answered next

    def arrivals(wanted: list[bytes], timeout: float = 5.0) -> dict[bytes, float]:
        """When each of the ``wanted`` notifications was seen (waiting up to ``timeout``
        for the last ones); everything seen so far is then forgotten."""
        deadline = time.monotonic() + timeout
        while any(m not in arrived for m in wanted) and time.monotonic() < deadline:
            drain()
        got = {m: arrived[m] for m in wanted if m in arrived}
        arrived.clear()
        return got

    serve(pipe, {"connect": agent.add_remote_agent, "poll": poll, "stop": lambda: notifs,
                 "arrivals": arrivals})


def nixl_initiator(pipe: Pipe, nbytes: int, tls: str, config: NixlConfig,
                   ucx_env: dict[str, str]) -> None:
    """Child: the initiator. Requests: ``("connect", metadata, address)``,
    ``("timed", size, messages, warm_up_s, written)`` -> seconds per timed message."""
    try:
        agent, _buf, address = _agent("lynx-bench-initiator", tls, config, nbytes, False, ucx_env)
    except ImportError as exc:
        pipe.send(("ok", {"unavailable": import_error(Engine.NIXL, exc)}))
        return
    from lynx_transport.protocol.pool import host_buffer  # noqa: PLC0415 - after _agent, like there

    written = host_buffer(nbytes, touch=True)  # the *_written groups: what real data gets
    sources = {False: address, True: int(written.ctypes.data)}
    agent.register_memory([(sources[True], nbytes, 0, "")], "DRAM")
    pipe.send(("ok", {"metadata": agent.get_agent_metadata()}))
    remote = ""
    remote_address = 0
    handles: dict[tuple[int, bool], Any] = {}

    def handle(size: int, from_written: bool) -> Any:
        if (size, from_written) not in handles:
            local = agent.get_xfer_descs([(sources[from_written], size, 0)], "DRAM")
            far = agent.get_xfer_descs([(remote_address, size, 0)], "DRAM")
            handles[size, from_written] = agent.initialize_xfer("WRITE", local, far, remote, NOTIFICATION)
        return handles[size, from_written]

    def write(size: int, from_written: bool) -> float:
        h = handle(size, from_written)
        start = time.perf_counter()
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer of {size} B failed: {state}")
        return time.perf_counter() - start

    def notified(size: int, messages: int, warm_up_s: float) -> dict[bytes, float]:
        """Writes that each carry a notification (its message number): the timed ones'
        notification -> the ``time.monotonic()`` their ``transfer`` was called."""
        h = handle(size, False)
        count = 0

        def send() -> tuple[bytes, float]:
            nonlocal count
            msg = str(count).encode()
            count += 1
            start = time.monotonic()
            state = agent.transfer(h, msg)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer of {size} B failed: {state}")
            return msg, start

        return dict(timed(send, messages, warm_up_s))

    def connect(metadata: Any, address: int) -> Any:
        nonlocal remote, remote_address
        remote = agent.add_remote_agent(metadata)
        remote_address = int(address)
        agent.make_connection(remote)  # documented: spares the first transfer the wire-up
        return remote

    serve(pipe, {"connect": connect, "timed": timed_writes(write), "notified": notified})


class NixlPair:
    """Parent side: the two processes of one configuration on one UCX path."""

    def __init__(self, nbytes: int, tls: str, config: NixlConfig, ucx_env: dict[str, str]) -> None:
        self.config = config
        self.target = PeerProcess(nixl_target, nbytes, tls, config, ucx_env)
        self.initiator = PeerProcess(nixl_initiator, nbytes, tls, config, ucx_env)

    def connect(self, timeout: float = 120.0) -> str | None:
        """Wait for both children and exchange metadata; the skip reason if NIXL cannot run."""
        target, initiator = self.target.reply(timeout), self.initiator.reply(timeout)
        for side in (target, initiator):
            if "unavailable" in side:
                return str(side["unavailable"])
        self.initiator.call("connect", target["metadata"], target["address"], timeout=timeout)
        self.target.call("connect", initiator["metadata"], timeout=timeout)
        return None

    def timed(self, size: int, messages: int, warm_up_s: float, written: bool = False) -> list[float]:
        """Seconds per message for ``messages`` writes of ``size`` bytes (after the warm-up),
        from the never-written buffer or (``written``) a written one."""
        polling = self.config == NixlConfig.POLLING
        if polling:
            self.target.call("poll")
        try:
            return list(self.initiator.call("timed", size, messages, warm_up_s, written, timeout=300.0))
        finally:
            if polling:
                self.target.call("stop")

    def notified(self, size: int, messages: int, warm_up_s: float) -> list[float]:
        """Seconds per message from the initiator's ``transfer`` to the target seeing its
        notification, for ``messages`` writes of ``size`` bytes after the warm-up; the
        target busy-polls (the polling configuration's way)."""
        self.target.call("poll")
        try:
            starts = self.initiator.call("notified", size, messages, warm_up_s, timeout=300.0)
        finally:
            self.target.call("stop")
        seen = self.target.call("arrivals", list(starts), timeout=60.0)
        missing = [m for m in starts if m not in seen]
        if missing:
            raise RuntimeError(f"NIXL: {len(missing)} of {len(starts)} notifications never arrived")
        return [seen[m] - t for m, t in starts.items()]

    def close(self) -> None:
        self.initiator.close()
        self.target.close()
