"""The receiving side: a control listener, a receive pool, and completion callbacks.

Usage::

    pool = ReceivePool(1 << 30)                       # allocated once
    with Receiver(pool, on_region=lambda s, r: ...) as rx:
        print(rx.address)                             # ("127.0.0.1", <port>)
        stream = rx.next_stream(timeout=10)           # manifest known, data not yet
        stream.wait_lane(Lane.ANCHOR, timeout=5)      # anchor bytes are in place
        stream.wait(timeout=30)
        k = stream.view("k")                          # NumPy view into the pool
        ...
        stream.release()

Threads: one I/O thread (``lynx-rx-io``) owns the UCX worker, the sockets and
all stream state; user callbacks run on one callback thread
(``lynx-rx-callbacks``), one at a time, in the order events happened (the
I/O thread's order of observation: regions it finds complete in one poll come in
manifest order), each exactly once and only after the bytes it reports are in place:

* ``on_stream_open(stream)`` - manifest accepted, pool carved, receives posted;
* ``on_chunk(stream, region, offset, nbytes)`` - one chunk landed (optional);
* ``on_region(stream, region)`` - every byte of a region landed;
* ``on_lane_complete(stream, lane)`` - every region on that lane landed;
* ``on_stream_complete(stream)`` / ``on_stream_failed(stream, error)`` - exactly
  one of them per opened stream (a cancelled stream reports
  ``StreamCancelledError`` through ``on_stream_failed``).

A callback that raises is logged and does not affect the transfer. Blocking
equivalents (``next_stream``, ``ReceiveStream.wait_region/wait_lane/wait``)
all take a timeout.

Data path: the sender reaches this process's UCX worker through the address
sent in WELCOME; for every chunk the receiver posts a tagged receive on a view
of the pool (tag = `wire.chunk_tag(stream token, chunk index)`), so bytes land in place
with no intermediate copy. The control channel (TCP, bound to 127.0.0.1 unless
told otherwise) carries manifests, confirmations and heartbeats; a closed socket
or ``peer_timeout_s`` of silence fails that peer's streams with
``PeerDisconnectedError``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

from lynx_transport._dispatch import Dispatcher
from lynx_transport._opened import OpenedStreams
from lynx_transport.config import TransportConfig
from lynx_transport.errors import ClosedError, TransportError
from lynx_transport.protocol.clock import Clock, MonotonicClock
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.shaper import Rate
from lynx_transport.receive_stream import ReceivedRegion, ReceiveStream
from lynx_transport.stats import TransportStats
from lynx_transport.ucx.receiver_loop import RxLoop

__all__ = ["Receiver"]

StreamCallback = Callable[[ReceiveStream], Any]


class Receiver:
    """Accepts streams into a :class:`ReceivePool`. See the module docstring."""

    def __init__(self, pool: ReceivePool, *, host: str = "127.0.0.1", port: int = 0,
                 config: TransportConfig | None = None, clock: Clock | None = None,
                 on_stream_open: StreamCallback | None = None,
                 on_chunk: Callable[[ReceiveStream, ReceivedRegion, int, int], Any] | None = None,
                 on_region: Callable[[ReceiveStream, ReceivedRegion], Any] | None = None,
                 on_lane_complete: Callable[[ReceiveStream, int], Any] | None = None,
                 on_stream_complete: StreamCallback | None = None,
                 on_stream_failed: Callable[[ReceiveStream, TransportError], Any] | None = None,
                 ) -> None:
        self.pool = pool
        self.config = config if config is not None else TransportConfig()
        self.clock = clock if clock is not None else MonotonicClock()
        callbacks = {"on_stream_open": on_stream_open, "on_chunk": on_chunk, "on_region": on_region,
                     "on_lane_complete": on_lane_complete, "on_stream_complete": on_stream_complete,
                     "on_stream_failed": on_stream_failed}
        # streams for next_stream(); bounded so a callback-only user leaks nothing
        self._opened = OpenedStreams()
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listen.bind((host, port))
            listen.listen(64)
            listen.setblocking(False)
        except OSError as exc:
            listen.close()
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from exc
        self._address: tuple[str, int] = listen.getsockname()[:2]
        self._dispatch = Dispatcher("lynx-rx-callbacks", self.config.thread_nice)
        net_devices = self.config.ucx_net_devices or _net_devices(self._address[0])
        try:
            self._loop = RxLoop(listen, pool, self.config, self.clock, net_devices=net_devices,
                                post=self._dispatch.post, callbacks=callbacks,
                                opened=self._stream_opened, release=self._release_from_user)
        except BaseException:
            listen.close()
            self._dispatch.stop(1.0)
            raise
        self._loop.start()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the control listener is bound to; give it to ``connect``."""
        return self._address

    def _call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        if self._opened.closed:
            raise ClosedError("the receiver is closed")
        return self._loop.run(fn, timeout)

    def _stream_opened(self, stream: ReceiveStream) -> None:
        """(I/O thread) A stream was admitted: queue it for :meth:`next_stream`."""
        self._opened.put(stream)

    def next_stream(self, timeout: float) -> ReceiveStream:
        """The next opened stream (manifest accepted, data may still be arriving).

        Streams are queued in the order they opened, whether or not
        ``on_stream_open`` is set; at most ``MAX_UNCLAIMED`` wait here (the
        oldest unclaimed ones are dropped from this queue, not from the transport).
        """
        return self._opened.next(timeout)

    def request_rate(self, rate: Rate | None) -> None:
        """Ask every connected (and future) sender to hold its connection to ``rate``
        (a sender with a shared egress holds that connection only)."""
        self._call(lambda: self._loop.request_rate(rate))

    def stats(self) -> TransportStats:
        """Per-lane bytes landed, achieved rates, bytes posted and not yet landed."""
        return self._call(self._loop.stats)

    def _release_from_user(self, stream: ReceiveStream) -> None:
        def free() -> None:
            for r in stream.regions:
                self.pool.release(r.offset, r.nbytes)
            if self._loop.alive:
                self._loop.admit_waiting(self.clock.now())
        if self._loop.alive:
            self._loop.call(free).result(5.0)
        else:
            free()

    def close(self, timeout: float = 5.0) -> None:
        """Fail active streams (``ClosedError``), close connections, stop the threads."""
        if not self._opened.close():
            return
        self._loop.stop(timeout)
        self._dispatch.stop(timeout)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _net_devices(host: str) -> str:
    """A receiver bound to loopback exposes its UCX worker on ``lo`` only."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return "lo" if loopback else "all"
