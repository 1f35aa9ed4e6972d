"""A non-blocking, framed control socket (owned by an I/O thread)."""

from __future__ import annotations

import socket

from lynx_transport.errors import PeerDisconnectedError
from lynx_transport.wire import Frame, FrameDecoder, FrameType, OversizedFrame, encode_frame

__all__ = ["ControlSocket"]


class ControlSocket:
    """Frames in and out of one TCP socket; tracks when it last heard and spoke."""

    def __init__(self, sock: socket.socket, max_payload: int, now: float) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        try:
            self.peer = "%s:%s" % sock.getpeername()[:2]
        except OSError:
            self.peer = "?"
        self._decoder = FrameDecoder(max_payload)
        self._out = bytearray()
        self.last_rx = now
        self.last_tx = now
        self.closed = False

    def limit(self, max_payload: int) -> None:
        """Change the largest frame payload accepted from now on (small before authentication)."""
        self._decoder.max_payload = max_payload

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, ftype: FrameType, payload: bytes, now: float) -> None:
        self._out += encode_frame(ftype, payload)
        self.last_tx = now
        self.flush()

    def flush(self) -> None:
        """Write what the kernel takes now; the rest waits for the next call."""
        while self._out:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise PeerDisconnectedError(f"control connection to {self.peer} broke: {exc}") from exc
            del self._out[:n]

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
        if not self.closed:
            self.closed = True
            try:
                self.flush()
            except PeerDisconnectedError:
                pass
            self.sock.close()
