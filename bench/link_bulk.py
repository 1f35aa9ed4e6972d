"""A bulk TCP transfer over plain sockets, to measure what an emulated link carries.

Run the receiver in one namespace and the sender in the other::

    ip netns exec lynx-rx python -m lynx_bench.link_bulk recv --bind 10.254.0.2
    #  -> {"event": "ready", "port": 41234}            (first line, once listening)
    ip netns exec lynx-tx python -m lynx_bench.link_bulk send --to 10.254.0.2 \\
        --port 41234 --bytes 375000000
    #  receiver -> {"event": "done", "bytes": ..., "seconds": ..., "gbps": ...}

The receiver times from its first byte to end of stream, so connection setup is
excluded; ``gbps`` is TCP payload (goodput), which on a link shaped at rate R by
htb (counting Ethernet frames) is about 0.95 R. :func:`measure` does both steps
on a :class:`~lynx_bench.link.Link`.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lynx_transport.errors import LinkError

if TYPE_CHECKING:
    from .link import Link

__all__ = ["BulkResult", "REALTIME", "receive", "send", "measure", "main"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class BulkResult:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


def receive(listener: socket.socket, timeout_s: float = 60.0) -> BulkResult:
    """Accept one connection on ``listener`` and read it to the end."""
    listener.settimeout(timeout_s)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(_CHUNK)
        total, first, last = 0, 0.0, 0.0
        while n := conn.recv_into(buf):
            last = time.perf_counter()
            if total == 0:
                first = last
            total += n
    return BulkResult(total, last - first)


def send(host: str, port: int, n_bytes: int, timeout_s: float = 60.0) -> None:
    """Connect to ``host:port`` and send ``n_bytes`` of zeros, then close."""
    block = bytes(_CHUNK)
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        left = n_bytes
        while left > 0:
            conn.sendall(block[: min(left, _CHUNK)])
            left -= _CHUNK
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the receiver to close: everything has landed


#: ``chrt`` prefix that runs both ends SCHED_FIFO, so that other load on a small
#: machine cannot starve them: on 2 busy cores unprioritised ends measured
#: 0.87-0.94 of a 1 Gbit/s link, prioritised ones 0.94-0.96 (idle: 0.95).
REALTIME = ("chrt", "--fifo", "20")


def measure(link: Link, n_bytes: int, timeout_s: float = 60.0,
            realtime: bool = False) -> BulkResult:
    """Send ``n_bytes`` from the tx namespace to the rx namespace and time it at the
    receiver; ``realtime`` runs both ends with :data:`REALTIME` (needs root).
    Raises :class:`LinkError` if either side fails."""
    me = [*(REALTIME if realtime else ()), sys.executable, "-m", "lynx_bench.link_bulk"]
    receiver = link.popen_in("rx", [*me, "recv", "--bind", link.address("rx"),
                                    "--timeout", str(timeout_s)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        ready = json.loads(receiver.stdout.readline() or "{}")
        if ready.get("event") != "ready":
            raise LinkError(f"bulk receiver did not start: {receiver.communicate()[1][-2000:]}")
        sent = link.run_in("tx", [*me, "send", "--to", link.address("rx"), "--port",
                                  str(ready["port"]), "--bytes", str(n_bytes),
                                  "--timeout", str(timeout_s)],
                           capture_output=True, text=True, timeout=timeout_s)
        if sent.returncode != 0:
            raise LinkError(f"bulk sender failed: {sent.stderr[-2000:]}")
        out, err = receiver.communicate(timeout=timeout_s)
        if receiver.returncode != 0:
            raise LinkError(f"bulk receiver failed: {err[-2000:]}")
        done = json.loads(out.strip().splitlines()[-1])
        return BulkResult(int(done["bytes"]), float(done["seconds"]))
    except subprocess.TimeoutExpired as exc:
        raise LinkError(f"bulk transfer did not finish within {timeout_s:g} s") from exc
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def _emit(obj: dict[str, object]) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: Sequence[str] | None = None, emit: Callable[[dict[str, object]], None] = _emit
         ) -> int:
    """``python -m lynx_bench.link_bulk recv|send``; one JSON object per line on stdout."""
    parser = argparse.ArgumentParser(prog="python -m lynx_bench.link_bulk")
    sub = parser.add_subparsers(dest="role", required=True)
    recv = sub.add_parser("recv", help="accept one connection and time it")
    recv.add_argument("--bind", required=True, help="address to listen on")
    recv.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    recv.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    snd = sub.add_parser("send", help="send zeros to a receiver")
    snd.add_argument("--to", required=True, help="receiver address")
    snd.add_argument("--port", type=int, required=True, help="receiver port")
    snd.add_argument("--bytes", type=int, required=True, help="how many bytes to send")
    snd.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    args = parser.parse_args(argv)
    if args.role == "recv":
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind((args.bind, args.port))
            listener.listen(1)
            emit({"event": "ready", "port": listener.getsockname()[1]})
            result = receive(listener, args.timeout)
        emit({"event": "done", "bytes": result.bytes, "seconds": result.seconds,
              "gbps": result.gbps})
    else:
        if args.bytes <= 0:
            parser.error("--bytes must be positive")
        send(args.to, args.port, args.bytes, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
