"""The queue behind ``Listener.next_stream``: admitted streams, in opening order, until claimed.

Shared by every listener (:class:`~lynx_transport.ucx.receiver.Receiver` and the in-memory
twin's): the transport's own thread puts, any thread waits with a timeout.
"""

from __future__ import annotations

import collections
import threading

from lynx_transport.errors import ClosedError, TransportTimeoutError
from lynx_transport.receive_stream import ReceiveStream

__all__ = ["MAX_UNCLAIMED", "OpenedStreams"]

#: Opened streams kept for ``next_stream`` until claimed (the oldest unclaimed are dropped
#: from this queue, not from the transport), so a callback-only user leaks nothing.
MAX_UNCLAIMED = 1024


class OpenedStreams:
    """Streams opened and not yet claimed; :meth:`close` wakes every waiter."""

    def __init__(self, maxlen: int = MAX_UNCLAIMED) -> None:
        self._streams: collections.deque[ReceiveStream] = collections.deque(maxlen=maxlen)
        self._cond = threading.Condition()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, stream: ReceiveStream) -> None:
        with self._cond:
            self._streams.append(stream)
            self._cond.notify()

    def next(self, timeout: float) -> ReceiveStream:
        """The oldest unclaimed stream; ``TransportTimeoutError`` after ``timeout`` s,
        ``ClosedError`` once closed."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._streams) or self._closed, timeout):
                raise TransportTimeoutError(f"no stream opened within {timeout} s")
            if not self._streams:
                raise ClosedError("the receiver was closed")
            return self._streams.popleft()

    def close(self) -> bool:
        """Close and wake every waiter; False when it was already closed."""
        with self._cond:
            was, self._closed = self._closed, True
            self._cond.notify_all()
            return not was
