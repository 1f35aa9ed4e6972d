"""Testing kit: deterministic payloads, a sender in a child process, and an in-memory transport.

Used by Lynx's own two-process tests and by ``lynx bench-transport``; handy for
anyone embedding the transport. A :class:`PeerProcess`
(:mod:`lynx_transport.peer_process`) runs :func:`sender_server` in a ``spawn``-ed
child and forwards every exception's full traceback to the parent (as
:class:`PeerFailed`), so a failure in the child is never a silent hang.
:class:`MemoryTransport` is an in-process twin of the UCX transport
(:mod:`lynx_transport.seam`), for fast tests of the layers above.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lynx_transport.memory.transport import MemoryTransport
from lynx_transport.peer_process import PeerFailed, PeerProcess
from lynx_transport.protocol.pool import host_buffer
from lynx_transport.protocol.views import as_bytes_view
from lynx_transport.protocol.wire import rail_of

__all__ = ["pattern", "WRITTEN_ZEROS", "UNTOUCHED", "PeerFailed", "PeerProcess", "sender_server",
           "receiver_server", "prioritise_thread", "RawPeer", "RawDataPath", "wait_until",
           "fake_receiver", "MemoryTransport"]


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Probe ``predicate`` every 5 ms; False if it is still false after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # probe
    return True


@contextlib.contextmanager
def fake_receiver(worker_address: bytes) -> Iterator[tuple[str, int]]:
    """A control-channel listener that answers the first HELLO with a WELCOME
    carrying ``worker_address`` (a hostile or broken receiver); yields its address."""
    from lynx_transport.protocol.wire import FrameType, encode_frame, pack_welcome  # noqa: PLC0415

    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen()

        def serve() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(100)
                conn.sendall(encode_frame(FrameType.WELCOME, pack_welcome(worker_address, 0.0, 0)))
                conn.recv(100)

        t = threading.Thread(target=serve)
        t.start()
        try:
            yield fake.getsockname()
        finally:
            t.join(10)


def prioritise_thread(nice: int = -10) -> int | None:
    """Give the calling thread (and the threads it starts from now on) a higher CPU priority.

    For timing tests on a shared machine: a shaped link or an anchor deadline
    measured in milliseconds should not depend on what else the box runs.
    Needs ``CAP_SYS_NICE`` (root); returns the previous nice value, or ``None``
    when the priority could not be raised (the test then runs at normal priority).
    """
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: PRIO_PROCESS 0 = this thread
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except (OSError, AttributeError):
        return None
    return before


#: :func:`pattern` seeds for zero payloads: every page written, or never written.
WRITTEN_ZEROS = -1
UNTOUCHED = -2


def pattern(seed: int, nbytes: int) -> Any:
    """``nbytes`` reproducible pseudo-random bytes (NumPy ``uint8``) for ``seed``.

    A negative seed gives zeros, for throughput runs that do not check bytes:
    ``WRITTEN_ZEROS`` (-1) writes every page, like real data; ``UNTOUCHED``
    (-2) allocates and never writes, like ``ucx_perftest``'s buffers: a peer's
    first read (cma) maps the kernel's shared (huge) zero page everywhere, and
    later reads of that one page copy faster than real memory.
    """
    import numpy as np  # noqa: PLC0415

    if seed < 0:
        return host_buffer(nbytes, touch=seed != UNTOUCHED)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _rate(spec: tuple[float, int] | None) -> Any:
    from lynx_transport.protocol.shaper import Rate  # noqa: PLC0415

    return None if spec is None else Rate(spec[0], spec[1])


def sender_server(pipe: multiprocessing.connection.Connection, address: tuple[str, int],
                  config: Any = None, nice: int | None = None) -> None:
    """Child side: connect to ``address`` and serve requests until ``("exit",)``.

    ``nice``: run the connection's threads at this priority (see :func:`prioritise_thread`).

    Requests (tuples), each answered with ``("ok", value)``:

    * ``("send", specs, metadata, timeout)`` - ``specs`` is ``[(name, nbytes, lane, seed)]``;
      sends :func:`pattern` bytes, waits for confirmation, returns timings.
    * ``("send_many", [(specs, metadata), ...], timeout)`` - opens all streams at once, then waits.
    * ``("start", specs, metadata[, hold])`` - send without waiting (holding the lanes in
      ``hold``); returns the stream id. ``("release", stream_id, lane)`` releases a held lane.
    * ``("wait", stream_id, timeout)`` - wait for a started stream; returns timings.
    * ``("cancel", stream_id, timeout)`` - cancel a started stream, wait for its end.
    * ``("incremental", specs, metadata, timeout)`` - ``open_stream`` first, then
      ``supply`` the regions one by one in reverse order; waits, returns timings.
    * ``("open", specs, metadata)`` - ``open_stream`` only (the manifest goes out, no
      data); returns the stream id. ``("supply", stream_id, name)`` supplies one region.
    * ``("close",)`` - close the connection (an orderly close, mid-stream if need be).
    * ``("link_rate", (gbps, burst) | None)``, ``("lane_rate", lane, (gbps, burst) | None)``.
    * ``("rates",)``, ``("stats",)``.
    """
    from lynx_transport.ucx.connection import connect  # noqa: PLC0415

    if nice is not None:
        prioritise_thread(nice)
    conn = connect(address, timeout=10.0, config=config)
    session = _SenderSession(conn)
    pipe.send(("ok", "connected"))
    try:
        while True:
            request = pipe.recv()
            if request[0] == "exit":
                return
            handler = _SENDER_OPS.get(request[0])
            if handler is None:
                raise ValueError(f"unknown request {request[0]!r}")
            pipe.send(("ok", handler(session, *request[1:])))
    finally:
        conn.close()


def _timings(stream: Any) -> dict[str, Any]:
    """What :func:`sender_server` reports of a stream: its end and its lanes' times."""
    opened = stream.opened_at
    return {
        "stream_id": stream.stream_id,
        "opened_at": opened,  # time.monotonic(): one clock for every process of the host
        "state": stream.state.value,
        "error": None if stream.exception() is None else
        f"{type(stream.exception()).__name__}: {stream.exception()}",
        "error_type": None if stream.exception() is None else type(stream.exception()).__name__,
        "lane_s": {int(k): v - opened for k, v in stream.lane_completed_at.items()},
        "lane_data_s": {} if stream.started_at is None else
        {int(k): v - stream.started_at for k, v in stream.lane_completed_at.items()},
        "total_s": None if stream.completed_at is None else stream.completed_at - opened,
        # first chunk handed to UCX -> receiver's confirmation (no handshake)
        "data_s": None if stream.completed_at is None or stream.started_at is None
        else stream.completed_at - stream.started_at,
    }


class _SenderSession:
    """:func:`sender_server`'s state: the connection, its streams, the buffers they send."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.keep: list[Any] = []  # buffers of streams in flight stay alive
        self.started: dict[int, Any] = {}
        self.opened_specs: dict[int, dict[str, tuple[int, int]]] = {}
        self.zeros: dict[tuple[int, int], Any] = {}  # seed < 0 buffers are reused: time the transfer

    def data(self, seed: int, n: int) -> Any:
        if seed >= 0:
            return pattern(seed, n)
        if (seed, n) not in self.zeros:
            self.zeros[seed, n] = pattern(seed, n)
        return self.zeros[seed, n]

    def start(self, specs: list, metadata: bytes, hold: tuple[int, ...] = ()) -> Any:
        buffers = [(name, self.data(seed, n), lane) for name, n, lane, seed in specs]
        self.keep.append(buffers)
        return self.conn.send_stream(buffers, metadata=metadata, hold=hold)

    def finish(self, stream: Any, timeout: float) -> dict[str, Any]:
        from lynx_transport.errors import TransportError  # noqa: PLC0415

        try:
            stream.wait(timeout)
        except TransportError:
            pass
        return _timings(stream)

    def send(self, specs: list, metadata: bytes, timeout: float) -> Any:
        result = self.finish(self.start(specs, metadata), timeout)
        self.keep.clear()
        return result

    def send_many(self, many: list, timeout: float) -> Any:
        streams = [self.start(specs, metadata) for specs, metadata in many]
        deadline = time.monotonic() + timeout
        result = [self.finish(s, max(0.0, deadline - time.monotonic())) for s in streams]
        self.keep.clear()
        return result

    def start_op(self, *args: Any) -> int:
        stream = self.start(*args)
        self.started[stream.stream_id] = stream
        return stream.stream_id

    def release(self, stream_id: int, lane: int) -> None:
        self.started[stream_id].release_lane(lane)

    def wait(self, stream_id: int, timeout: float) -> Any:
        return self.finish(self.started.pop(stream_id), timeout)

    def cancel(self, stream_id: int, timeout: float) -> Any:
        stream = self.started.pop(stream_id)
        stream.cancel()
        return self.finish(stream, timeout)

    def incremental(self, specs: list, metadata: bytes, timeout: float) -> Any:
        stream = self.conn.open_stream([(name, n, lane) for name, n, lane, _ in specs], metadata)
        buffers = [(name, self.data(seed, n)) for name, n, _, seed in specs]
        for name, buf in reversed(buffers):
            stream.supply(name, buf)
        return self.finish(stream, timeout)

    def open(self, specs: list, metadata: bytes) -> int:
        stream = self.conn.open_stream([(name, n, lane) for name, n, lane, _ in specs], metadata)
        self.started[stream.stream_id] = stream
        self.keep.append({name: (n, seed) for name, n, _, seed in specs})
        self.opened_specs[stream.stream_id] = self.keep[-1]
        return stream.stream_id

    def supply(self, stream_id: int, name: str) -> None:
        n, seed = self.opened_specs[stream_id][name]
        buf = self.data(seed, n)
        self.keep.append(buf)
        self.started[stream_id].supply(name, buf)

    def close(self) -> None:
        self.conn.close()

    def link_rate(self, spec: tuple[float, int] | None) -> None:
        self.conn.set_link_rate(_rate(spec))

    def lane_rate(self, lane: int, spec: tuple[float, int] | None) -> None:
        self.conn.set_lane_rate(lane, _rate(spec))

    def rates(self) -> Any:
        return {k: (None if v is None else (v.gbps, v.burst_bytes))
                for k, v in self.conn.rates().items()}

    def stats(self) -> Any:
        return self.conn.stats()


#: :func:`sender_server`'s requests: ``(op, *args)`` -> ``handler(session, *args)``.
_SENDER_OPS: dict[str, Callable[..., Any]] = {
    "send": _SenderSession.send, "send_many": _SenderSession.send_many,
    "start": _SenderSession.start_op, "release": _SenderSession.release,
    "wait": _SenderSession.wait, "cancel": _SenderSession.cancel,
    "incremental": _SenderSession.incremental, "open": _SenderSession.open,
    "supply": _SenderSession.supply, "close": _SenderSession.close,
    "link_rate": _SenderSession.link_rate, "lane_rate": _SenderSession.lane_rate,
    "rates": _SenderSession.rates, "stats": _SenderSession.stats,
}


def receiver_server(pipe: multiprocessing.connection.Connection, pool_bytes: int,
                    config: Any = None) -> None:
    """Child side: a :class:`~lynx_transport.ucx.receiver.Receiver`; replies with its address first.

    Requests: ``("next", timeout)`` waits for the next stream to complete and
    returns ``{name: bytes.hex() of the first 16 bytes}``; ``("exit",)``.
    """
    from lynx_transport.protocol.pool import ReceivePool  # noqa: PLC0415
    from lynx_transport.ucx.receiver import Receiver  # noqa: PLC0415

    with Receiver(ReceivePool(pool_bytes), config=config) as rx:
        pipe.send(("ok", rx.address))
        while True:
            request = pipe.recv()
            if request[0] == "exit":
                return
            if request[0] == "next":
                stream = rx.next_stream(request[1])
                stream.wait(request[1])
                result = {r.name: bytes(stream.view(r.name)[:16]).hex() for r in stream.regions}
                stream.release()
                pipe.send(("ok", result))
            else:
                raise ValueError(f"unknown request {request[0]!r}")


class RawPeer:
    """A hand-written control-channel client: what a hostile or buggy peer can send.

    ``frames`` keeps every frame received and not yet taken by :meth:`expect`;
    ``received`` is every byte that ever arrived (to check what was exposed).
    """

    def __init__(self, address: tuple[str, int], timeout: float = 5.0) -> None:
        from lynx_transport.protocol.wire import FrameDecoder  # noqa: PLC0415

        self.sock = socket.create_connection(address, timeout=timeout)
        self.decoder = FrameDecoder(1 << 20)
        self.frames: list[Any] = []
        self.received = bytearray()

    def send(self, ftype: Any, payload: bytes = b"") -> None:
        from lynx_transport.protocol.wire import encode_frame  # noqa: PLC0415

        self.sock.sendall(encode_frame(ftype, payload))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> bool:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return False
        if not data:
            return False
        self.received += data
        self.frames.extend(self.decoder.feed(data))
        return True

    def expect(self, ftype: Any) -> Any:
        """The next frame of type ``ftype`` (others are kept); fails if the peer closes first."""
        while True:
            for i, f in enumerate(self.frames):
                if f.type is ftype:
                    return self.frames.pop(i)
            assert self._more(), f"connection closed while waiting for {ftype.name}"

    def drain_until_closed(self) -> list[Any]:
        """Every frame until the peer closes the connection (socket timeout bounds the wait)."""
        while self._more():
            pass
        out, self.frames = self.frames, []
        return out

    def handshake(self, secret: bytes | None = None) -> Any:
        """HELLO (and PROOF when ``secret``) until WELCOME; returns the WELCOME frame."""
        import secrets as _secrets  # noqa: PLC0415

        from lynx_transport.protocol import auth  # noqa: PLC0415
        from lynx_transport.protocol.wire import FrameType, HelloFlags, pack_hello, unpack_challenge  # noqa: PLC0415

        nonce = _secrets.token_bytes(32)
        self.send(FrameType.HELLO, pack_hello(HelloFlags.AUTH if secret else HelloFlags.NONE, nonce))
        if secret is not None:
            nonce_r, _ = unpack_challenge(self.expect(FrameType.CHALLENGE).payload)
            self.send(FrameType.PROOF, auth.sender_mac(secret, nonce_r, nonce))
        return self.expect(FrameType.WELCOME)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawDataPath:
    """A bare UCX worker that sends arbitrary tagged messages to a receiver's worker.

    With :class:`RawPeer` it plays a hostile or buggy sender on the data path:
    short, long, corrupted or misaddressed chunks. Owned by the calling thread.
    """

    def __init__(self, worker_addresses: bytes | Sequence[bytes], tls: str = "^posix,sysv",
                 net_devices: str = "lo") -> None:
        from lynx_transport.ucx.adapter import UcxWorker  # noqa: PLC0415

        self.worker = UcxWorker(tls, net_devices)
        addresses = ([worker_addresses] if isinstance(worker_addresses, bytes)
                     else list(worker_addresses))
        # like a real sender: one endpoint per receive rail (wire.rail_of)
        self.eps = [self.worker.endpoint(a) for a in addresses]
        self._keep: list[Any] = []

    def send(self, tag: int, data: Any, timeout: float = 5.0) -> None:
        """Send ``data`` with ``tag`` and progress until UCX has taken it (or ``timeout``)."""
        from lynx_transport.ucx.adapter import check  # noqa: PLC0415

        view = as_bytes_view(data)
        # the tag's low 32 bits are the chunk index
        req = self.worker.tag_send(self.eps[rail_of(tag & 0xFFFFFFFF, len(self.eps))], view, tag)
        deadline = time.monotonic() + timeout
        while not req.completed:
            self.worker.progress()
            if time.monotonic() > deadline:
                self._keep.append((req, view))  # never drop a live request (cancels it)
                raise TimeoutError(f"tagged send of {view.nbytes} bytes did not complete")
        check(req, "raw send")

    def close(self) -> None:
        for _ in range(100):
            self.worker.progress()
        self._keep.clear()
        self.eps = []
        self.worker.close()

    def __enter__(self) -> RawDataPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
