"""The processes of ``make vllm-bench`` (:mod:`lynx_bench.vllm.bench`) and where they run: a
:class:`Server` (one process in a session of its own, with its log, ``/health`` probe and stop),
:func:`wait_ready`, a :class:`Caller` (this process's HTTP calls, from a thread inside a network
namespace when the servers live in one), :class:`Hosts` (which namespace and address each role
has on a link, or loopback) and :func:`role_cpus` (which cores each server may run on).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, ClassVar, TypeVar

from lynx_bench.common.errors import VllmNodeError
from lynx_bench.netem.link import Link

__all__ = ["READY_S", "STOP_S", "Server", "wait_ready", "Caller", "Hosts", "role_cpus", "pinned"]

READY_S = 600.0      # two vLLM servers starting at once on two busy cores
STOP_S = 20.0

_T = TypeVar("_T")


class Server:
    """One server process in a session of its own (stopping it ends vLLM's engine core too)."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict[str, str], host: str = "127.0.0.1",
                 caller: Caller | None = None) -> None:
        self.name, self.port, self.log, self.host = name, port, log, host
        self.caller = caller or Caller(None)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self._out.write(f"$ {shlex.join(argv)}\n".encode())
        self._out.flush()
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ready(self) -> bool:
        """Whether ``/health`` answers 200; :class:`VllmNodeError` with its log if the process died."""
        import httpx  # noqa: PLC0415 - the vLLM environment has it

        if self.proc.poll() is not None:
            raise VllmNodeError(f"{self.name} exited with {self.proc.returncode}; the end of its log "
                                f"({self.log}):\n{self.tail()}")
        try:
            return self.caller(lambda: httpx.get(f"{self.url}/health", timeout=5.0, trust_env=False).status_code == 200)
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM to the session, up to ``STOP_S`` to end, then SIGKILL to what is left of it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        self._out.close()


def wait_ready(servers: Sequence[Server], timeout_s: float = READY_S) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        waiting = [s for s in waiting if not s.ready()]
        if waiting and time.monotonic() > deadline:
            raise VllmNodeError(f"not ready within {timeout_s:.0f} s: {[s.name for s in waiting]}; "
                                + "; ".join(f"{s.name}'s log:\n{s.tail()}" for s in waiting))
        if waiting:
            time.sleep(1.0)  # between /health probes


def _enter_namespace(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` (``setns(2)`` affects one thread)."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Caller:
    """Runs this process's HTTP calls where the servers can be reached: here (``namespace`` None),
    or on one thread that lives inside ``namespace`` (``close`` ends it)."""

    def __init__(self, namespace: str | None) -> None:
        self.namespace = namespace
        self._pool = (None if namespace is None else concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"netns-{namespace}", initializer=_enter_namespace, initargs=(namespace,)))

    def __call__(self, fn: Callable[[], _T]) -> _T:
        return fn() if self._pool is None else self._pool.submit(fn).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Hosts:
    """Where one link's processes run: all here on loopback (``link`` None), or the producer in a
    ``lynx link up --hosts 2`` link's ``tx`` namespace, the consumer in ``rx0``, and the proxy, the
    benchmark client and this process's requests (:class:`Caller`) in ``rx1``."""

    ROLES: ClassVar[dict[str, str]] = {"producer": "tx", "consumer": "rx0", "client": "rx1"}

    def __init__(self, link: Link | None) -> None:
        self.link = link
        self.caller = Caller(None if link is None else link.namespace("rx1"))

    def argv(self, role: str, argv: list[str]) -> list[str]:
        return argv if self.link is None else self.link.exec_argv(self.ROLES[role], argv)

    def address(self, role: str) -> str:
        return "127.0.0.1" if self.link is None else self.link.address(self.ROLES[role])

    def ucx_env(self, role: str) -> dict[str, str] | None:
        """UCX pinned to tcp on the role's veth; None on loopback."""
        return None if self.link is None else self.link.ucx_env(self.ROLES[role])

    def close(self) -> None:
        self.caller.close()


def role_cpus(available: Iterable[int]) -> dict[str, tuple[int, ...]]:
    """The cores each server may run on, as if each were a node of its own: the producer (or the one
    plain server) the first half of ``available``, the consumer the rest. The proxy and the benchmark
    client (role ``client``) are not pinned; with fewer than two cores nothing is (empty)."""
    cpus = sorted(set(available))
    if len(cpus) < 2:
        return {}
    half = len(cpus) // 2
    return {"producer": tuple(cpus[:half]), "consumer": tuple(cpus[half:])}


def pinned(argv: list[str], cpus: Sequence[int]) -> list[str]:
    """``argv`` run on ``cpus`` only (``taskset -c``; its threads and children inherit it), or as it
    is when ``cpus`` is empty. :class:`VllmNodeError` when cores are asked for and ``taskset`` is not
    on ``PATH``, before anything starts."""
    if not cpus:
        return list(argv)
    if shutil.which("taskset") is None:
        raise VllmNodeError("pinning the servers to cores needs taskset, which is not on PATH: install "
                            "util-linux (apt-get install util-linux), or pass --no-pin")
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv]
