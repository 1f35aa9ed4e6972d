"""No round trip before the first byte: a stream's chunks leave right behind its OPEN_SENT.

The receiver here is a stand-in written with the transport's own pieces (a UCX
worker, the wire format): it answers HELLO with a WELCOME and then says nothing
until the stream's bytes have landed in its memory. A sender that waited for any
control reply (ACCEPT) before sending would never deliver them; the real sender
does. Offered no ``OPEN_SENT`` (``max_open`` 0, as an older receiver), the same
sender sends ``OPEN`` and waits for its ACCEPT: no chunk comes before it.

And no thread hand-off before the first byte either (``send_from_caller``): with
the sender's I/O thread waiting, ``send_stream`` hands the first chunk to UCX on
the caller's own thread (a real receiver here).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import numpy as np
import pytest

from lynx_transport import Lane, ReceivePool, Receiver, TransportConfig
from lynx_transport.protocol import wire
from lynx_transport.protocol.manifest import decode_manifest
from lynx_transport.protocol.wire import Frame, FrameDecoder, FrameType, encode_frame
from lynx_transport.testing import pattern
from lynx_transport.ucx import adapter
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.connection import connect

CFG = TransportConfig(chunk_bytes=64 << 10, rails=1)
KEY = 0x5A5A5
NBYTES = 3 * (64 << 10)  # three chunks


class SilentReceiver:
    """Welcomes one sender, reads its frames, and replies only when told to."""

    def __init__(self, max_open: int) -> None:
        self.worker = UcxWorker(CFG.ucx_tls)
        self.listen = socket.create_server(("127.0.0.1", 0))
        self.max_open = max_open
        self.frames: list[Frame] = []
        self.replies = 0
        self.sock: socket.socket | None = None
        self.decoder = FrameDecoder(1 << 20)

    @property
    def address(self) -> tuple[str, int]:
        return self.listen.getsockname()

    def welcome(self) -> None:
        self.sock, _ = self.listen.accept()
        self.next_frame(FrameType.HELLO)
        self.reply(FrameType.WELCOME, wire.pack_welcome(self.worker.address, 0.0, 0,
                                                        conn_key=KEY, max_open=self.max_open))
        self.replies = 0  # the handshake's; what counts is after it

    def next_frame(self, ftype: FrameType, timeout: float = 10.0) -> Frame:
        assert self.sock is not None
        deadline = time.monotonic() + timeout
        while True:
            for frame in self.frames:
                if frame.type is ftype:
                    self.frames.remove(frame)
                    return frame
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(1 << 16)
            assert data, "the sender closed the control connection"
            self.frames += [f for f in self.decoder.feed(data) if isinstance(f, Frame)]

    def reply(self, ftype: FrameType, payload: bytes) -> None:
        assert self.sock is not None
        self.sock.sendall(encode_frame(ftype, payload))
        self.replies += 1

    def receive(self, token: int, nbytes: int, wait_s: float) -> tuple[np.ndarray | None, int]:
        """Post the stream's chunk receives and progress until they land (or ``wait_s``
        passes): the bytes (``None`` if not all landed) and the replies sent meanwhile."""
        into = np.zeros(nbytes, np.uint8)
        cb = CFG.chunk_bytes
        requests = [self.worker.tag_recv(into[off:off + cb], wire.chunk_tag(token, i))
                    for i, off in enumerate(range(0, nbytes, cb))]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not all(r.completed for r in requests):
            self.worker.progress()
            time.sleep(1e-4)
        landed = all(r.completed for r in requests)
        if not landed:
            for r in requests:
                adapter.cancel(r)
            self.worker.progress()
        return (into if landed else None), self.replies

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.listen.close()
        self.worker.close()


def _run(max_open: int, wait_s: float) -> tuple[Frame, np.ndarray | None, int]:
    rx = SilentReceiver(max_open)
    try:
        t = threading.Thread(target=rx.welcome)
        t.start()
        conn = connect(rx.address, timeout=10.0, config=CFG)
        t.join(10)
        data = pattern(7, NBYTES)
        stream = conn.send_stream([("anchor", data, Lane.ANCHOR)])
        expected = FrameType.OPEN_SENT if max_open else FrameType.OPEN
        frame = rx.next_frame(expected)
        sid = decode_manifest(frame.payload, CFG.manifest_limits).stream_id
        token = wire.stream_token(KEY, sid)
        got, replies = rx.receive(token, NBYTES, wait_s)
        if got is not None:  # let the sender finish as a real receiver would
            rx.reply(FrameType.ACCEPT, wire.pack_stream_token(sid, token))
            rx.reply(FrameType.STREAM_DONE, wire.pack_u64(sid))
            stream.wait(10)
            assert np.array_equal(got, data)
        conn.close()
        return frame, got, replies
    finally:
        rx.close()


def test_the_chunks_land_before_the_receiver_says_anything() -> None:
    frame, got, replies = _run(max_open=1 << 20, wait_s=30.0)
    assert frame.type is FrameType.OPEN_SENT
    assert got is not None, "the chunks never came without an ACCEPT"
    assert replies == 0  # every byte was in place before the first control reply


def test_a_receiver_that_offers_no_open_sent_gets_open_and_no_chunk_before_accept() -> None:
    frame, got, replies = _run(max_open=0, wait_s=0.3)
    assert frame.type is FrameType.OPEN
    assert got is None and replies == 0


@pytest.mark.parametrize("on", [True, False], ids=["send_from_caller", "through_the_io_thread"])
def test_the_first_chunk_leaves_from_the_callers_thread_when_the_io_thread_waits(on: bool) -> None:
    cfg = dataclasses.replace(CFG, send_from_caller=on)
    with Receiver(ReceivePool(4 << 20), config=cfg,
                  on_stream_complete=lambda s: s.release()) as rx:
        conn = connect(rx.address, timeout=10.0, config=cfg)
        worker = conn._loop.worker
        send = worker.tag_send
        first: dict[int, str] = {}  # stream token -> the thread that handed its first chunk to UCX

        def recording(endpoint, view, tag):  # observes; the real send still happens
            first.setdefault(tag >> wire.CHUNK_BITS, threading.current_thread().name)
            return send(endpoint, view, tag)

        worker.tag_send = recording
        try:
            me = threading.current_thread().name
            for _ in range(10):
                time.sleep(0.05)  # the I/O thread goes back to waiting (on the epoll fd)
                conn.send_stream([("anchor", pattern(3, NBYTES), Lane.ANCHOR)]).wait(30)
        finally:
            conn.close()
    assert len(first) == 10
    mine = sum(name == me for name in first.values())
    if on:  # the I/O thread holds its lock only while it works: most sends find it free
        assert mine >= 1, first
    else:
        assert mine == 0 and set(first.values()) == {"lynx-tx-io"}, first
