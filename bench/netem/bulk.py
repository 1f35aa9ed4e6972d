"""A bulk TCP transfer over plain sockets, to measure what an emulated link carries.

Run the receiver in one namespace and the sender in the other::

    ip netns exec lynx-rx python -m lynx_bench.netem.bulk recv --bind 10.254.0.2
    #  -> {"event": "ready", "port": 41234}            (first line, once listening)
    ip netns exec lynx-tx python -m lynx_bench.netem.bulk send --to 10.254.0.2 \\
        --port 41234 --bytes 375000000
    #  receiver -> {"event": "done", "bytes": ..., "seconds": ..., "gbps": ...}

The receiver times from its first byte to end of stream, so connection setup is
excluded; ``gbps`` is TCP payload (goodput), which on a link shaped at rate R by
htb (counting Ethernet frames) is about 0.95 R. :func:`measure` does both steps
on a :class:`~lynx_bench.netem.link.Link`; :func:`measure_fanout` sends from the prefill
host to several decode hosts at once and reports the sum, both as goodput and as
the bytes the prefill's htb let out (which should be R, not K x R). The receiver
also reports when its first byte came (``first``, ``CLOCK_MONOTONIC``: one clock
for every process on the machine), so concurrent transfers can be added up over
the time they span together.
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

from lynx_bench.common.errors import LinkError
from lynx_transport.errors import ConfigError

from .config import Host, HostRef
from .status import htb_sent_bytes

if TYPE_CHECKING:
    from .link import Link

__all__ = ["BulkResult", "FanoutResult", "REALTIME", "receive", "send", "measure",
           "measure_fanout", "main"]

_CHUNK = 1 << 20


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # comparable across processes


@dataclass(frozen=True)
class BulkResult:
    bytes: int
    seconds: float  # first byte to end of stream
    first: float = 0.0  # CLOCK_MONOTONIC when the first byte arrived

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class FanoutResult:
    """Concurrent transfers from the prefill host, one per decode host."""

    per_host: tuple[tuple[Host, BulkResult], ...]
    htb_bytes: int  # what the prefill's root htb class let out during the transfers

    @property
    def bytes(self) -> int:
        return sum(r.bytes for _, r in self.per_host)

    @property
    def seconds(self) -> float:
        """From the first byte at any receiver to the last byte at any receiver."""
        results = [r for _, r in self.per_host]
        return max(r.first + r.seconds for r in results) - min(r.first for r in results)

    @property
    def gbps(self) -> float:
        """Summed goodput over :attr:`seconds`."""
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def htb_gbps(self) -> float:
        """What the prefill's htb let out over :attr:`seconds` (frames, as htb counts)."""
        return self.htb_bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


def receive(listener: socket.socket, timeout_s: float = 60.0) -> BulkResult:
    """Accept one connection on ``listener`` and read it to the end."""
    listener.settimeout(timeout_s)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(_CHUNK)
        total, first, last = 0, 0.0, 0.0
        while n := conn.recv_into(buf):
            last = _now()
            if total == 0:
                first = last
            total += n
    return BulkResult(total, last - first, first)


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
            realtime: bool = False, to: HostRef = "rx") -> BulkResult:
    """Send ``n_bytes`` from the tx namespace to decode host ``to`` (the only one by
    default) and time it at the receiver; ``realtime`` runs both ends with
    :data:`REALTIME` (needs root). Raises :class:`LinkError` if either side fails."""
    return measure_fanout(link, n_bytes, (to,), timeout_s, realtime).per_host[0][1]


def measure_fanout(link: Link, n_bytes: int, to: Sequence[HostRef] | None = None,
                   timeout_s: float = 60.0, realtime: bool = False) -> FanoutResult:
    """Send ``n_bytes`` from the prefill host to each decode host in ``to`` (default:
    all of them) at once, one TCP stream and one sender process each. Raises
    :class:`ConfigError` for an unknown or repeated host, :class:`LinkError` if any
    end fails or the transfers take longer than ``timeout_s``."""
    hosts = link.decode_hosts if to is None else tuple(link.host(h) for h in to)
    if not hosts or len(set(hosts)) != len(hosts):
        raise ConfigError(f"measure to one or more distinct decode hosts, got {list(to or ())!r}")
    me = [*(REALTIME if realtime else ()), sys.executable, "-m", "lynx_bench.netem.bulk"]
    tx = link.prefill_host
    deadline = time.monotonic() + timeout_s
    children: list[subprocess.Popen[str]] = []
    try:
        receivers = []
        for host in hosts:
            receivers.append(link.popen_in(host, [*me, "recv", "--bind", link.address(host),
                                                  "--timeout", str(timeout_s)],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True))
            children.append(receivers[-1])
        ports = []
        for receiver in receivers:
            assert receiver.stdout is not None
            ready = json.loads(receiver.stdout.readline() or "{}")
            if ready.get("event") != "ready":
                raise LinkError(f"bulk receiver did not start: {receiver.communicate()[1][-2000:]}")
            ports.append(int(ready["port"]))
        before = htb_sent_bytes(link.namespace(tx), link.device(tx))
        senders = []
        for host, port in zip(hosts, ports):
            senders.append(link.popen_in(tx, [*me, "send", "--to", link.address(host), "--port",
                                              str(port), "--bytes", str(n_bytes),
                                              "--timeout", str(timeout_s)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True))
            children.append(senders[-1])
        for sender in senders:
            _, err = sender.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if sender.returncode != 0:
                raise LinkError(f"bulk sender failed: {err[-2000:]}")
        results = []
        for host, receiver in zip(hosts, receivers):
            out, err = receiver.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if receiver.returncode != 0:
                raise LinkError(f"bulk receiver failed: {err[-2000:]}")
            done = json.loads(out.strip().splitlines()[-1])
            results.append((host, BulkResult(int(done["bytes"]), float(done["seconds"]),
                                             float(done["first"]))))
        after = htb_sent_bytes(link.namespace(tx), link.device(tx))
        return FanoutResult(tuple(results), after - before)
    except subprocess.TimeoutExpired as exc:
        raise LinkError(f"bulk transfer did not finish within {timeout_s:g} s") from exc
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def _emit(obj: dict[str, object]) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: Sequence[str] | None = None, emit: Callable[[dict[str, object]], None] = _emit
         ) -> int:
    """``python -m lynx_bench.netem.bulk recv|send``; one JSON object per line on stdout."""
    parser = argparse.ArgumentParser(prog="python -m lynx_bench.netem.bulk")
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
              "first": result.first, "gbps": result.gbps})
    else:
        if args.bytes <= 0:
            parser.error("--bytes must be positive")
        send(args.to, args.port, args.bytes, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
