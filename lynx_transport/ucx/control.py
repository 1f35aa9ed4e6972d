"""A non-blocking, framed control socket (owned by an I/O thread), and the peer-liveness rule.

Both sides keep a control connection alive the same way: a heartbeat when this side
has been silent for ``heartbeat_interval_s`` (sent by the loop's
:class:`~lynx_transport.ucx.heartbeat.Heartbeats` thread, :meth:`ControlSocket.heartbeat_if_due`,
and by the I/O thread itself in :meth:`ControlSocket.keep_alive`), and the peer declared
lost (``PeerDisconnectedError``) after ``peer_timeout_s`` without a sign of life from it.
A sign of life is any byte: a frame read, a byte still waiting unread in the socket
(an I/O thread that was kept from running finds its peer's heartbeats there, not
silence), or a data chunk the loop saw land from that peer (:meth:`ControlSocket.heard`).
A closed or broken connection is not silence: it fails at once.

The I/O thread owns the socket; the only other writer is the heartbeat thread, and
every write goes through one lock, so frames never interleave.
"""

from __future__ import annotations

import socket
import threading

from lynx_transport.errors import PeerDisconnectedError
from lynx_transport.protocol.wire import Frame, FrameDecoder, FrameType, OversizedFrame, encode_frame

__all__ = ["ControlSocket"]


class ControlSocket:
    """Frames in and out of one TCP socket; tracks when it last heard and spoke."""

    def __init__(self, sock: socket.socket, max_payload: int, now: float) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"
        self._decoder = FrameDecoder(max_payload)
        self._out = bytearray()
        self.last_rx = now
        self.last_tx = now
        self.closed = False
        self._lock = threading.Lock()  # the I/O thread's writes vs the heartbeat thread's

    def limit(self, max_payload: int) -> None:
        """Change the largest frame payload accepted from now on (small before authentication)."""
        self._decoder.max_payload = max_payload

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, ftype: FrameType, payload: bytes, now: float) -> None:
        with self._lock:
            self._out += encode_frame(ftype, payload)
            self.last_tx = now
            self._flush()

    def heartbeat_if_due(self, now: float, heartbeat_s: float) -> None:
        """Send a HEARTBEAT if this side said nothing for ``heartbeat_s`` (any thread).

        Never raises: a broken socket is left for the I/O thread to find."""
        with self._lock:
            if self.closed or now - self.last_tx < heartbeat_s:
                return
            self._out += encode_frame(FrameType.HEARTBEAT, b"")
            self.last_tx = now
            try:
                self._flush()
            except PeerDisconnectedError:
                pass

    def heard(self, now: float) -> None:
        """The peer showed a sign of life other than a frame (a data chunk landed)."""
        self.last_rx = max(self.last_rx, now)

    def flush(self) -> None:
        """Write what the kernel takes now; the rest waits for the next call."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        while self._out:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise PeerDisconnectedError(f"control connection to {self.peer} broke: {exc}") from exc
            del self._out[:n]

    def keep_alive(self, now: float, heartbeat_s: float, timeout_s: float, who: str = "peer") -> float:
        """Flush, check the peer is alive, send a heartbeat when one is due.

        Raises ``PeerDisconnectedError`` when nothing arrived for ``timeout_s``
        (``who`` names the peer in the message) or the socket broke; sends a
        HEARTBEAT when this side said nothing for ``heartbeat_s``. Returns when
        the next check is due. (A receiver's connection still in its handshake
        is bound by ``handshake_timeout_s`` instead, and sends nothing.)
        """
        self.flush()
        if now - self.last_rx > timeout_s and self._bytes_waiting():
            self.last_rx = now  # the peer spoke; this thread had not read it yet
        if now - self.last_rx > timeout_s:
            raise PeerDisconnectedError(f"{who} {self.peer} silent for {now - self.last_rx:.2f} s "
                                        f"(limit {timeout_s} s)")
        self.heartbeat_if_due(now, heartbeat_s)
        return min(self.last_rx + timeout_s, self.last_tx + heartbeat_s)

    def _bytes_waiting(self) -> bool:
        """Whether unread bytes wait in the socket (they are left there for :meth:`read`);
        raises ``PeerDisconnectedError`` on EOF or a socket error."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise PeerDisconnectedError(f"control connection to {self.peer} broke: {exc}") from exc
        if not data:
            raise PeerDisconnectedError(f"peer {self.peer} closed the control connection")
        return True

    @property
    def pending_output(self) -> bool:
        return bool(self._out)

    def read(self, now: float) -> list[Frame | OversizedFrame]:
        """Frames that arrived; raises ``PeerDisconnectedError`` on EOF or a socket error."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            raise PeerDisconnectedError(f"control connection to {self.peer} broke: {exc}") from exc
        if not data:
            raise PeerDisconnectedError(f"peer {self.peer} closed the control connection")
        self.last_rx = now
        return list(self._decoder.feed(data))

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._flush()
            except PeerDisconnectedError:
                pass
            self.sock.close()
