"""Baselines for ``lynx bench-transport``: raw ucxx, plain asyncio TCP and ``ucx_perftest``.

Each baseline moves the same messages between two processes on loopback, so
every Lynx number comes with its reference measured in the same run. The raw
ucxx baseline uses the same UCX path as Lynx (worker-address endpoints without
peer-error handling, the same ``UCX_TLS``, ``UCX_NET_DEVICES=lo`` as a
loopback-bound Lynx receiver, one tagged message per transfer into a
preallocated buffer, the worker polled by the calling thread);
``ucx_perftest`` runs ``tag_bw`` with the same ``UCX_TLS`` and net devices and
without ``-e`` (no error handling). ``ucx_perftest`` never writes its buffers,
so over cma its receiver copies from the kernel's shared zero page; the UCX
baselines here send from such an untouched buffer too (like for like) and
from a written one (what real data gets).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

__all__ = ["RawUcxxSender", "TcpSender", "raw_ucxx_receiver", "raw_ucxx_send", "tcp_receiver", "tcp_send",
           "ucx_perftest_gbps", "ucx_perftest_latency_us"]


# -- raw ucxx ------------------------------------------------------------------------------
def _worker(tls: str) -> tuple[Any, Any, Any]:
    import ucxx._lib.libucxx as lib  # noqa: PLC0415

    # loopback only, as a Lynx receiver bound to 127.0.0.1 exposes its worker
    ctx = lib.UCXContext(config_dict={"TLS": tls, "NET_DEVICES": "lo"},
                         feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
    return lib, ctx, lib.UCXWorker(ctx)


def _wait(worker: Any, request: Any) -> None:
    while not request.completed:
        worker.progress()
    request.check_error()


def raw_ucxx_receiver(pipe: Pipe, nbytes: int, tls: str) -> None:
    """Child: post one tagged receive per request, answer (with the last byte) when the
    bytes are in place. The buffer's last byte is set to 255 first; senders send zeros."""
    from ucxx._lib.arr import Array  # noqa: PLC0415

    lib, _ctx, worker = _worker(tls)  # the context stays referenced while the worker runs
    from lynx_transport.protocol.pool import host_buffer  # noqa: PLC0415

    buf = host_buffer(nbytes, touch=False)  # 2 MiB-aligned like a Lynx pool ...
    buf.fill(255)  # ... and pre-faulted: every page written once, here
    pipe.send(("ok", bytes(worker.address)))
    while True:
        request = pipe.recv()
        if request[0] == "exit":
            return
        tag = request[1]
        buf[-1] = 255
        recv = worker.tag_recv(Array(buf), lib.UCXXTag(tag))
        pipe.send(("ok", "posted"))
        _wait(worker, recv)
        pipe.send(("ok", int(buf[-1])))


class RawUcxxSender:
    """Parent side of the raw ucxx baseline: sends from a written or an untouched buffer
    (see :func:`lynx_transport.testing.pattern`)."""

    def __init__(self, address: bytes, nbytes: int, tls: str) -> None:
        from ucxx._lib.arr import Array  # noqa: PLC0415

        from lynx_transport.testing import UNTOUCHED, WRITTEN_ZEROS, pattern  # noqa: PLC0415

        self.lib, self.ctx, self.worker = _worker(tls)
        self.ep = self.worker.create_endpoint_from_worker_address(
            self.lib.UCXAddress.create_from_buffer(address), False)
        self.bufs = {seed: Array(pattern(seed, nbytes)) for seed in (WRITTEN_ZEROS, UNTOUCHED)}
        self.tag = 0

    def send(self, peer: Any, seed: int) -> float:
        """One message from the ``seed`` buffer; seconds from the send to the receiver's
        confirmation."""
        self.tag += 1
        assert peer.call("post", self.tag) == "posted"
        start = time.perf_counter()
        request = self.ep.tag_send(self.bufs[seed], self.lib.UCXXTag(self.tag))
        _wait(self.worker, request)
        assert peer.reply(60) == 0
        return time.perf_counter() - start


def raw_ucxx_send(address: bytes, nbytes: int, tls: str) -> RawUcxxSender:
    return RawUcxxSender(address, nbytes, tls)


# -- asyncio TCP ---------------------------------------------------------------------------
def tcp_receiver(pipe: Pipe, nbytes: int) -> None:
    """Child: an asyncio TCP server that reads each message into a preallocated buffer."""
    async def main() -> None:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        loop = asyncio.get_running_loop()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        pipe.send(("ok", listener.getsockname()))
        conn, _ = await loop.sock_accept(listener)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            got = 0
            while got < nbytes:
                n = await loop.sock_recv_into(conn, view[got:])
                if n == 0:
                    return
                got += n
            await loop.sock_sendall(conn, b"k")

    asyncio.run(main())


class TcpSender:
    def __init__(self, address: tuple[str, int], nbytes: int) -> None:
        self.payload = bytes(nbytes)
        self.address = address
        self.loop = asyncio.new_event_loop()
        self.reader, self.writer = self.loop.run_until_complete(asyncio.open_connection(*address))

    def send(self) -> float:
        async def one() -> float:
            start = time.perf_counter()
            self.writer.write(self.payload)
            await self.writer.drain()
            assert await self.reader.readexactly(1) == b"k"
            return time.perf_counter() - start
        return self.loop.run_until_complete(one())

    def close(self) -> None:
        self.writer.close()
        self.loop.close()


def tcp_send(address: tuple[str, int], nbytes: int) -> TcpSender:
    return TcpSender(address, nbytes)


# -- ucx_perftest ----------------------------------------------------------------------------
def perftest_binary() -> tuple[pathlib.Path, dict[str, str]] | None:
    """The ``ucx_perftest`` shipped in the libucx wheel, with the environment it needs."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    libs = [str(root / "lib"), str(root.parent / "libucx_cu12.libs")]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([*libs, env.get("LD_LIBRARY_PATH", "")])
    return binary, env


def ucx_perftest_gbps(nbytes: int, iterations: int, tls: str, timeout: float = 120.0,
                      warmup: int = 1) -> float:
    """``ucx_perftest -t tag_bw`` between two processes on loopback, ``warmup`` untimed
    iterations first; decimal Gbit/s."""
    # columns: iterations, 3 x overhead (us), bandwidth average, overall (MB/s = 2^20 B/s)
    fields = _perftest("tag_bw", nbytes, iterations, tls, timeout, warmup)
    return float(fields[5]) * (1 << 20) * 8 / 1e9


def ucx_perftest_latency_us(nbytes: int, iterations: int, tls: str, timeout: float = 120.0,
                            warmup: int = 1) -> float:
    """``ucx_perftest -t tag_lat`` (a ping-pong) between two processes on loopback: its own
    50th percentile of half a round trip, one message's one-way time, in microseconds."""
    # columns: iterations, latency 50th percentile, average, overall (us), then bandwidth
    return float(_perftest("tag_lat", nbytes, iterations, tls, timeout, warmup)[1])


def _perftest(test: str, nbytes: int, iterations: int, tls: str, timeout: float,
              warmup: int) -> list[str]:
    """The ``Final:`` line's fields of one ``ucx_perftest -t test`` run."""
    found = perftest_binary()
    if found is None:
        raise FileNotFoundError("ucx_perftest is not in the libucx wheel")
    binary, env = found
    env["UCX_TLS"] = tls
    env["UCX_NET_DEVICES"] = "lo"
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-t", test, "-s", str(nbytes), "-n", str(iterations), "-w", str(warmup),
            "-p", str(port)]
    server = subprocess.Popen([str(binary), *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:  # probe until the server listens
            client = subprocess.run([str(binary), "127.0.0.1", *args], env=env, capture_output=True,
                                    text=True, timeout=max(1.0, deadline - time.monotonic()))
            final = re.search(r"^Final:\s+(.*)$", client.stdout, re.M)
            if final:
                return final.group(1).split()
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"ucx_perftest failed: {client.stdout[-500:]} {client.stderr[-500:]}")
            time.sleep(0.2)
    finally:
        server.kill()
        server.wait(10)
