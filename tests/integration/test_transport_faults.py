"""Faults: dead ports, silent peers, killed senders, hostile or oversized manifests, a full pool."""

from __future__ import annotations

import dataclasses
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from lynx_transport import Lane, ReceivePool, Receiver, StreamState, TransportConfig, connect
from lynx_transport.errors import ClosedError, ConnectError, PeerDisconnectedError, StreamCancelledError
from lynx_transport.protocol import wire
from lynx_transport.protocol.manifest import Manifest, ManifestLimits, RegionSpec, encode_manifest
from lynx_transport.protocol.shaper import Rate
from lynx_transport.protocol.wire import (
    FrameDecoder,
    FrameType,
    RejectReason,
    encode_frame,
    unpack_stream_text,
    unpack_stream_token,
)
from lynx_transport.testing import PeerProcess, fake_receiver, pattern, receiver_server, sender_server

pytestmark = pytest.mark.ucx

CONFIG = TransportConfig(chunk_bytes=64 * 1024, max_inflight_bytes=256 * 1024)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connect_to_a_port_where_nobody_listens_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(ConnectError, match="cannot connect") as refused:
        connect(("127.0.0.1", free_port()), timeout=30.0)
    assert isinstance(refused.value.__cause__, ConnectionRefusedError)  # refused, not timed out
    assert time.monotonic() - start < 10.0  # a generous bound, well inside the 30 s allowed


def test_connect_to_a_silent_listener_fails_within_the_timeout() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        start = time.monotonic()
        with pytest.raises(ConnectError, match="handshake"):
            connect(silent.getsockname(), timeout=0.5)
        # not before the timeout (it waited for a WELCOME); and not much after it (a generous
        # bound: 10x the timeout)
        assert 0.4 < time.monotonic() - start < 5.0


def start_receiver(pool: ReceivePool, config: TransportConfig = CONFIG, **callbacks) -> Receiver:
    return Receiver(pool, config=config, **callbacks)


def spawn_sender(rx: Receiver, config: TransportConfig = CONFIG) -> PeerProcess:
    peer = PeerProcess(sender_server, rx.address, config)
    assert peer.reply(60) == "connected"
    return peer


# Killed, closed and SIGSTOPped senders at every point of a stream (x3 each):
# tests/integration/test_transport_fault_matrix.py


#: Heartbeats that would take a minute to declare the killed receiver dead: what fails the
#: stream below is its closed connection, not the peer timeout.
PATIENT = dataclasses.replace(CONFIG, peer_timeout_s=60.0)


def test_receiver_killed_mid_stream_fails_the_senders_stream_at_once() -> None:
    with PeerProcess(receiver_server, 128 << 20, PATIENT) as peer:
        address = peer.reply(60)
        with connect(tuple(address), timeout=10, config=PATIENT) as conn:
            conn.set_link_rate(Rate(0.5, 64 * 1024))
            data = np.full(64 << 20, 3, np.uint8)
            stream = conn.send_stream([("big", data, Lane.RESIDUAL)])
            deadline = time.monotonic() + 30
            while stream.state is StreamState.OPENING and time.monotonic() < deadline:
                time.sleep(0.005)  # probe: wait until the receiver accepted the stream
            assert stream.state is StreamState.ACTIVE
            killed = time.monotonic()
            peer.kill()
            with pytest.raises(PeerDisconnectedError) as lost:
                stream.wait(timeout=30)
            assert "silent" not in str(lost.value)  # noticed by the closed connection ...
            assert time.monotonic() - killed < 10.0  # ... long before the 60 s peer timeout
            assert stream.state is StreamState.FAILED
            assert conn.broken is not None


def test_receiver_closed_mid_stream_fails_the_senders_stream() -> None:
    pool = ReceivePool(128 << 20)
    rx = start_receiver(pool)
    with spawn_sender(rx) as peer:
        peer.call("link_rate", (0.5, 64 * 1024))
        sid = peer.call("start", [("big", 64 << 20, Lane.RESIDUAL, -1)], b"")
        stream = rx.next_stream(30)
        rx.close()
        assert stream.state is StreamState.FAILED
        result = peer.call("wait", sid, 10.0)
        assert result["state"] == "failed"
        assert result["error_type"] == "PeerDisconnectedError"


def test_cancelled_stream_ends_cancelled_on_both_sides_and_frees_the_pool() -> None:
    pool = ReceivePool(128 << 20)
    landed = threading.Event()
    rx = start_receiver(pool, on_chunk=lambda s, r, off, n: landed.set())
    try:
        with spawn_sender(rx) as peer:
            peer.call("link_rate", (0.5, 64 * 1024))
            sid = peer.call("start", [("big", 32 << 20, Lane.RESIDUAL, -1)], b"")
            stream = rx.next_stream(30)
            assert landed.wait(30)
            result = peer.call("cancel", sid, 10.0)
            assert result["state"] == "cancelled" and result["error_type"] == "StreamCancelledError"
            with pytest.raises(StreamCancelledError):
                stream.wait(5)
            assert stream.state is StreamState.CANCELLED
            peer.call("link_rate", None)
            assert peer.call("send", [("a", 4096, Lane.ANCHOR, 1)], b"", 30.0)["state"] == "completed"
            rx.next_stream(30).release()
        deadline = time.monotonic() + 5
        while pool.free_bytes != pool.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)  # probe
        assert pool.free_bytes == pool.nbytes
    finally:
        rx.close()


class RawPeer:
    """A hand-written control-channel client: what a hostile or buggy peer can send."""

    def __init__(self, address) -> None:
        self.sock = socket.create_connection(address, timeout=5)
        self.decoder = FrameDecoder(1 << 20)
        self.frames: list = []

    def send(self, ftype: FrameType, payload: bytes) -> None:
        self.sock.sendall(encode_frame(ftype, payload))

    def expect(self, ftype: FrameType):
        while True:
            for i, f in enumerate(self.frames):
                if f.type is ftype:
                    return self.frames.pop(i)
            data = self.sock.recv(65536)
            assert data, f"connection closed while waiting for {ftype.name}"
            self.frames.extend(self.decoder.feed(data))


def test_malformed_and_oversized_manifests_are_rejected_and_the_connection_stays_usable() -> None:
    pool = ReceivePool(16 << 20)
    rx = start_receiver(pool)
    try:
        raw = RawPeer(rx.address)
        raw.send(FrameType.HELLO, wire.pack_hello(wire.HelloFlags.NONE, bytes(32)))
        raw.expect(FrameType.WELCOME)
        # garbage manifest
        raw.send(FrameType.OPEN, struct.pack("!QIII", 7, 65536, 0xFFFF_FFFF, 0))
        sid, code, text = unpack_stream_text(raw.expect(FrameType.REJECT).payload)
        assert (sid, code) == (7, RejectReason.MANIFEST) and "regions exceed" in text
        # a region past the end of the payload (truncated)
        raw.send(FrameType.OPEN, struct.pack("!QIII", 8, 65536, 1, 0) + b"\x00\x00")
        sid, code, text = unpack_stream_text(raw.expect(FrameType.REJECT).payload)
        assert (sid, code) == (8, RejectReason.MANIFEST) and "truncated" in text
        # a frame far larger than any manifest may be: skipped, never buffered
        big = rx.config.manifest_limits.max_encoded_bytes + 1000
        raw.send(FrameType.OPEN, (9).to_bytes(8, "big") + bytes(big - 8))
        sid, code, text = unpack_stream_text(raw.expect(FrameType.REJECT).payload)
        assert (sid, code) == (9, RejectReason.MANIFEST) and "exceeds" in text
        # a valid (empty-region) stream on the same connection still completes
        ok = Manifest(10, 65536, (RegionSpec("e", 0, Lane.ANCHOR),), b"meta")
        raw.send(FrameType.OPEN, encode_manifest(ok, ManifestLimits()))
        assert unpack_stream_token(raw.expect(FrameType.ACCEPT).payload)[0] == 10
        raw.expect(FrameType.STREAM_DONE)
        rx.next_stream(5).release()
        assert pool.free_bytes == pool.nbytes
        # bad magic: that connection is dropped, the receiver carries on
        raw.sock.sendall(b"JUNK" + bytes(8))
        while raw.sock.recv(65536):  # heartbeats may still be queued; then EOF
            pass
        raw.sock.close()
        with spawn_sender(rx) as peer:
            assert peer.call("send", [("a", 3 << 20, Lane.RESIDUAL, 3)], b"", 30.0)["state"] == "completed"
            s = rx.next_stream(30)
            assert np.array_equal(s.view("a"), pattern(3, 3 << 20))
            s.release()
    finally:
        rx.close()


def test_manifest_over_the_receivers_limits_is_refused_then_the_next_stream_works() -> None:
    strict = TransportConfig(chunk_bytes=64 * 1024, max_inflight_bytes=256 * 1024,
                             manifest_limits=ManifestLimits(max_regions=4, max_metadata_bytes=64))
    pool = ReceivePool(16 << 20)
    rx = start_receiver(pool, config=strict)
    try:
        with spawn_sender(rx) as peer:
            many = [(f"r{i}", 1000, Lane.ANCHOR, i) for i in range(6)]
            result = peer.call("send", many, b"", 30.0)
            assert result["state"] == "failed" and result["error_type"] == "ManifestError"
            assert "regions exceed" in result["error"]
            result = peer.call("send", [("a", 1000, Lane.ANCHOR, 1)], b"x" * 65, 30.0)
            assert result["error_type"] == "ManifestError" and "metadata" in result["error"]
            result = peer.call("send", [("a", 1 << 20, Lane.ANCHOR, 1)], b"ok", 30.0)
            assert result["state"] == "completed"
            s = rx.next_stream(30)
            assert np.array_equal(s.view("a"), pattern(1, 1 << 20))
            s.release()
            assert pool.free_bytes == pool.nbytes
    finally:
        rx.close()


def test_pool_exhaustion_waits_for_space_then_fails_with_a_clear_error() -> None:
    cfg = TransportConfig(chunk_bytes=64 * 1024, max_inflight_bytes=256 * 1024, pool_wait_s=0.3)
    pool = ReceivePool(4 << 20)
    rx = start_receiver(pool, config=cfg)
    try:
        with spawn_sender(rx, cfg) as peer:
            # larger than the whole pool: refused at once
            result = peer.call("send", [("a", 5 << 20, Lane.ANCHOR, -1)], b"", 30.0)
            assert result["error_type"] == "PoolExhaustedError"
            # fits, but the pool is held by an unreleased stream: refused after pool_wait_s
            assert peer.call("send", [("a", 3 << 20, Lane.ANCHOR, -1)], b"", 30.0)["state"] == "completed"
            held = rx.next_stream(30)
            start = time.monotonic()
            result = peer.call("send", [("b", 3 << 20, Lane.ANCHOR, -1)], b"", 30.0)
            assert result["error_type"] == "PoolExhaustedError", result
            assert "release finished streams" in result["error"]
            assert time.monotonic() - start >= 0.3
            assert np.all(held.view("a") == 0)  # live data untouched
            # a stream cancelled while it waits for room is never admitted
            sid = peer.call("start", [("d", 3 << 20, Lane.ANCHOR, -1)], b"")
            assert peer.call("cancel", sid, 10.0)["state"] == "cancelled"
            # back-pressure: a stream waiting for room is admitted when room appears
            sid = peer.call("start", [("c", 3 << 20, Lane.ANCHOR, 4)], b"")
            held.release()
            assert peer.call("wait", sid, 30.0)["state"] == "completed"
            s = rx.next_stream(30)
            assert [r.name for r in s.regions] == ["c"]
            assert np.array_equal(s.view("c"), pattern(4, 3 << 20))
            s.release()
    finally:
        rx.close()


def test_close_wakes_a_blocked_next_stream_with_closed_error() -> None:
    rx = start_receiver(ReceivePool(1 << 20))
    got: list[BaseException] = []

    def wait() -> None:
        try:
            rx.next_stream(timeout=30)
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    rx.close()
    t.join(10)
    assert not t.is_alive()
    assert len(got) == 1 and isinstance(got[0], ClosedError)


def _lynx_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lynx-"))


def _one_cycle() -> None:
    pool = ReceivePool(8 << 20)
    with Receiver(pool, config=CONFIG) as rx, connect(rx.address, timeout=10, config=CONFIG) as conn:
        data = pattern(9, 3 << 20)
        s = conn.send_stream([("a", data, Lane.ANCHOR)])
        stream = rx.next_stream(30)
        s.wait(30)
        stream.wait(30)
        assert np.array_equal(stream.view("a"), data)
        stream.release()
    assert pool.free_bytes == pool.nbytes


def test_close_leaves_no_threads_or_file_descriptors_behind() -> None:
    import psutil

    _one_cycle()  # UCX's process-wide state (e.g. its own fds) is created once
    before = psutil.Process().num_fds()
    for _ in range(3):
        _one_cycle()
    assert _lynx_threads() == []
    assert psutil.Process().num_fds() <= before


def test_a_welcome_with_a_garbage_worker_address_is_a_connect_error() -> None:
    with fake_receiver(b"garbage") as address, pytest.raises(ConnectError, match="malformed"):
        connect(address, timeout=5)
    assert _lynx_threads() == []


COLD_SENDER = r"""
import sys
import numpy as np
from lynx_transport import Lane, TransportConfig, connect
cfg = TransportConfig(heartbeat_interval_s=0.1, peer_timeout_s=0.5)
with connect(("127.0.0.1", int(sys.argv[1])), timeout=10, config=cfg) as conn:
    conn.send_stream([("a", np.arange(1 << 20, dtype=np.uint8), Lane.ANCHOR)]).wait(10)
print("sent")
"""


def test_a_sender_in_a_fresh_process_is_not_silent_after_the_handshake() -> None:
    """A process's first UCX start takes most of a second; it happens before the
    handshake, so a receiver counting silence from its WELCOME (0.5 s here) keeps
    the connection."""
    cfg = TransportConfig(heartbeat_interval_s=0.1, peer_timeout_s=0.5)
    got: list[bytes] = []
    with start_receiver(ReceivePool(16 << 20), cfg,
                        on_stream_complete=lambda s: (got.append(bytes(s.view("a")[:4])),
                                                      s.release())) as rx:
        child = subprocess.run([sys.executable, "-c", COLD_SENDER, str(rx.address[1])],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        assert "sent" in child.stdout
        assert got == [bytes([0, 1, 2, 3])]
