"""The typed seam between ``lynx_transport`` and the layers above it.

``lynx_decode`` (the KV stream path, the prefill and decode nodes) talks to a
:class:`Transport`: it ``connect``\\ s to a receiver and gets a :class:`Sender`,
or ``listen``\\ s with a receive pool and gets a :class:`Listener`. The stream
handles, :class:`~lynx_transport.send_stream.SendStream` and
:class:`~lynx_transport.receive_stream.ReceiveStream`, are the same classes for
every transport: an implementation drives them through their completion record
and the hooks its I/O side sets, so their waits, states and errors behave alike
everywhere.

A sending node with several receivers shares one egress among its
connections: :meth:`Transport.egress` makes one (:class:`EgressLike`: one
scheduler and one egress shaper, so lane priority, the lane policy and the
node's link rate hold across all its peers); ``connect`` is the one-receiver
case, a connection with an egress of its own.

Two implementations:

* :data:`lynx_transport.UCX` (:class:`~lynx_transport.ucx.transport.UcxTransport`): the
  real one, :func:`~lynx_transport.connect` and :class:`~lynx_transport.Receiver` (UCX
  data path, TCP control channel).
* ``lynx_transport.testing.MemoryTransport``: an in-process twin with the same
  semantics (lanes in priority order, a shared egress, held lanes, cancel,
  abandon, a peer that goes away) and no sockets, for fast tests of the layers above.

Both pass one conformance suite (``tests/unit/test_transport_conformance.py``).

Threads: who calls what, and what may block, is the same for both:

* ``Transport.connect`` / ``Transport.listen`` / ``Transport.egress``: any thread;
  ``connect`` blocks up to ``timeout`` (connect, then the handshake).
* ``EgressLike`` methods: any thread, as ``Sender``'s; its connections are
  senders like any other.
* ``Sender`` methods: any thread; each hands work to the transport's I/O side
  and waits at most its ``timeout`` for the hand-off (never for the transfer).
* ``Listener`` callbacks (:class:`ReceiverCallbacks`): one callback thread per
  listener, one callback at a time, in the order events happened, each once and
  only after the bytes it reports are in place (regions that the I/O side finds
  complete in the same poll are reported in manifest order). A callback that
  raises is logged.

Errors: everything raised is a :class:`~lynx_transport.errors.TransportError`
(``ConnectError`` when nobody listens, ``PeerDisconnectedError`` when the peer
goes, ``TransportTimeoutError`` when a wait runs out, ...), as documented on
each method of the UCX implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from lynx_transport.config import TransportConfig
from lynx_transport.errors import TransportError
from lynx_transport.protocol.manifest import RegionSpec
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.protocol.shaper import Rate
from lynx_transport.receive_stream import ReceivedRegion, ReceiveStream
from lynx_transport.send_stream import SendStream

__all__ = ["EgressLike", "Listener", "ReceiverCallbacks", "Sender", "Transport"]


@dataclasses.dataclass(frozen=True)
class ReceiverCallbacks:
    """What a listener calls, on its callback thread (see the module docstring).

    * ``on_stream_open(stream)``: manifest accepted, pool carved, receives posted;
    * ``on_chunk(stream, region, offset, nbytes)``: one chunk landed;
    * ``on_region(stream, region)``: every byte of a region landed;
    * ``on_lane_complete(stream, lane)``: every region on that lane landed;
    * ``on_stream_complete(stream)`` / ``on_stream_failed(stream, error)``:
      exactly one of them per opened stream.
    """

    on_stream_open: Callable[[ReceiveStream], Any] | None = None
    on_chunk: Callable[[ReceiveStream, ReceivedRegion, int, int], Any] | None = None
    on_region: Callable[[ReceiveStream, ReceivedRegion], Any] | None = None
    on_lane_complete: Callable[[ReceiveStream, int], Any] | None = None
    on_stream_complete: Callable[[ReceiveStream], Any] | None = None
    on_stream_failed: Callable[[ReceiveStream, TransportError], Any] | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Sender(Protocol):
    """A connection to one receiver: what :meth:`Transport.connect` returns."""

    @property
    def broken(self) -> TransportError | None:
        """Why the connection can no longer be used (``None`` while it is healthy)."""

    def open_stream(self, regions: Sequence[RegionSpec | tuple[str, int, int]],
                    metadata: bytes = b"", timeout: float = 5.0,
                    hold: Iterable[int] = ()) -> SendStream:
        """Announce a stream (names, sizes, lanes, metadata); its bytes follow with
        ``SendStream.supply``. ``hold``: lanes not sent until released. Raises
        ``ValueError`` for a bad region list, the connection's error when it is
        broken, ``ClosedError`` once closed."""

    def send_stream(self, regions: Sequence[tuple[str, Any, int]], metadata: bytes = b"",
                    timeout: float = 5.0, hold: Iterable[int] = ()) -> SendStream:
        """Announce and supply ``[(name, buffer, lane), ...]`` at once (buffers stay
        alive and unchanged until the stream is done)."""

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape the whole connection (at once, also mid-stream); ``None``: unshaped."""

    def close(self, timeout: float = 5.0) -> None:
        """Fail active streams (``ClosedError``), say goodbye, stop. Idempotent."""

    def __enter__(self) -> Sender: ...

    def __exit__(self, *exc: object) -> None: ...


class EgressLike(Protocol):
    """One sending node's egress, shared by its connections: what
    :meth:`Transport.egress` returns. Methods: any thread."""

    def connect(self, address: tuple[str, int], *, timeout: float) -> Sender:
        """Connect to the listener at ``address``, as :meth:`Transport.connect`;
        the connection shares this egress's scheduler and link rate.
        ``ClosedError`` once the egress is closed."""

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape the node's egress: one rate for all connections together (at once,
        also mid-stream); ``None``: unshaped. A connection's own
        ``set_link_rate`` caps that connection only."""

    def peers(self) -> list[tuple[str, int]]:
        """``(host, port)`` of each live connection (a broken or closed one is gone)."""

    def close(self, timeout: float = 5.0) -> None:
        """Close every connection (active streams fail with ``ClosedError``), stop. Idempotent."""

    def __enter__(self) -> EgressLike: ...

    def __exit__(self, *exc: object) -> None: ...


class Listener(Protocol):
    """Accepts streams into a receive pool: what :meth:`Transport.listen` returns."""

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` senders ``connect`` to."""

    def next_stream(self, timeout: float) -> ReceiveStream:
        """The next opened stream (data may still be arriving), in opening order;
        ``TransportTimeoutError`` after ``timeout`` s, ``ClosedError`` once closed."""

    def close(self, timeout: float = 5.0) -> None:
        """Fail active streams (``ClosedError``), close connections, stop. Idempotent."""

    def __enter__(self) -> Listener: ...

    def __exit__(self, *exc: object) -> None: ...


class Transport(Protocol):
    """Makes senders and listeners; one object per kind of transport."""

    def connect(self, address: tuple[str, int], *, timeout: float,
                config: TransportConfig | None = None) -> Sender:
        """Connect to the listener at ``address``; ``ConnectError`` (within
        ``timeout`` for each of the connect and the handshake) if nobody listens
        or the handshake fails."""

    def egress(self, config: TransportConfig | None = None) -> EgressLike:
        """A shared egress for a sending node with several receivers: one scheduler
        and one egress shaper for every connection made through it (``config``
        applies to each; its ``link_rate``/``lane_rates`` shape the egress as a
        whole). Any thread; starts the egress at once (UCX: slow the first time
        in a process); the caller closes it."""

    def listen(self, pool: ReceivePool, *, host: str = "127.0.0.1", port: int = 0,
               config: TransportConfig | None = None,
               callbacks: ReceiverCallbacks | None = None) -> Listener:
        """Listen on ``(host, port)`` (0: an ephemeral port), receiving into ``pool``;
        ``TransportError`` when the address cannot be bound."""
