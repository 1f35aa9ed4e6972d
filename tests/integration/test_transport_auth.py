"""Authentication: a peer without the shared secret never sees the worker address or the pool."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lynx_transport import Lane, ReceivePool, Receiver, TransportConfig, connect
from lynx_transport.errors import AuthenticationError, TransportTimeoutError
from lynx_transport.protocol.wire import FrameType, HelloFlags, encode_frame, pack_hello, unpack_challenge
from lynx_transport.testing import RawPeer, fake_receiver, pattern

pytestmark = pytest.mark.ucx

SECRET = b"correct horse battery staple"
BASE = dict(chunk_bytes=64 * 1024, max_inflight_bytes=256 * 1024)
RX = TransportConfig(secret=SECRET, **BASE)


def _no_stream_opened(rx: Receiver, pool: ReceivePool) -> None:
    with pytest.raises(TransportTimeoutError):
        rx.next_stream(0.05)
    assert rx.stats().active_streams == 0
    assert pool.free_bytes == pool.nbytes


def test_the_listener_binds_to_loopback_by_default() -> None:
    with Receiver(ReceivePool(1 << 20)) as rx:
        assert rx.address[0] == "127.0.0.1"


def test_the_right_secret_authenticates_both_sides_and_data_flows() -> None:
    pool = ReceivePool(8 << 20)
    with Receiver(pool, config=RX) as rx, \
            connect(rx.address, timeout=10, config=TransportConfig(secret=SECRET, **BASE)) as conn:
        data = pattern(1, 300_000)
        s = conn.send_stream([("a", data, Lane.ANCHOR)])
        stream = rx.next_stream(10)
        s.wait(10)
        stream.wait(10)
        assert np.array_equal(stream.view("a"), data)
        stream.release()


@pytest.mark.parametrize("secret", [b"wrong horse battery staple", None], ids=["wrong", "none"])
def test_a_sender_with_a_wrong_or_no_secret_is_refused_and_logged(
        secret: bytes | None, caplog: pytest.LogCaptureFixture) -> None:
    pool = ReceivePool(8 << 20)
    caplog.set_level(logging.WARNING, logger="lynx_transport")
    with Receiver(pool, config=RX) as rx:
        with pytest.raises(AuthenticationError, match="refused|prove"):
            connect(rx.address, timeout=10, config=TransportConfig(secret=secret, **BASE))
        _no_stream_opened(rx, pool)
    # refused: logged with the peer address (the receiver's loop has stopped: all logged)
    refusals = [r for r in caplog.records if "refused connection from 127.0.0.1:" in r.getMessage()]
    assert refusals and all(r.levelno == logging.WARNING for r in refusals)
    # the secrets never reach a log line
    assert not any(SECRET.decode() in r.getMessage() for r in caplog.records)


def test_a_wrong_proof_is_denied_logged_and_never_sees_the_worker_address(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = ReceivePool(8 << 20)
    caplog.set_level(logging.WARNING, logger="lynx_transport")
    with Receiver(pool, config=RX) as rx:
        with RawPeer(rx.address) as raw:
            raw.send(FrameType.HELLO, pack_hello(HelloFlags.AUTH, bytes(32)))
            unpack_challenge(raw.expect(FrameType.CHALLENGE).payload)
            raw.send(FrameType.PROOF, b"\x00" * 32)
            frames = raw.drain_until_closed()
            port = raw.sock.getsockname()[1]
        assert [f.type for f in frames] == [FrameType.DENIED]
        _no_stream_opened(rx, pool)
        # a correctly authenticated peer is welcomed: the address it gets was never sent before
        with RawPeer(rx.address) as good:
            address = good.handshake(SECRET).payload
        assert address[-32:] not in bytes(raw.received)
    assert any(f"127.0.0.1:{port}" in r.getMessage() and "wrong shared secret" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("first", [FrameType.OPEN, FrameType.HEARTBEAT, FrameType.PROOF])
def test_frames_before_authentication_are_denied_before_any_memory_is_exposed(first: FrameType) -> None:
    pool = ReceivePool(8 << 20)
    with Receiver(pool, config=RX) as rx:
        with RawPeer(rx.address) as raw:
            raw.send(first, b"\x00" * 32)
            assert [f.type for f in raw.drain_until_closed()] == [FrameType.DENIED]
        _no_stream_opened(rx, pool)


def test_a_huge_frame_before_authentication_is_dropped_without_buffering_it() -> None:
    pool = ReceivePool(8 << 20)
    with Receiver(pool, config=RX) as rx, RawPeer(rx.address) as raw:
        raw.send_raw(encode_frame(FrameType.HELLO, b"")[:-4] + (1 << 30).to_bytes(4, "big"))
        assert raw.drain_until_closed() == []
        _no_stream_opened(rx, pool)


def test_a_silent_unauthenticated_peer_is_dropped_after_the_handshake_timeout() -> None:
    cfg = TransportConfig(secret=SECRET, handshake_timeout_s=0.3, heartbeat_interval_s=0.1,
                          peer_timeout_s=5.0, **BASE)
    with Receiver(ReceivePool(1 << 20), config=cfg) as rx, RawPeer(rx.address) as raw:
        raw.send(FrameType.HELLO, pack_hello(HelloFlags.AUTH, bytes(32)))
        raw.expect(FrameType.CHALLENGE)
        assert raw.drain_until_closed() == []  # closed by the receiver, not our 5 s timeout


def test_a_sender_with_a_secret_refuses_a_receiver_that_cannot_prove_it() -> None:
    """The sender never hands an unauthenticated worker address to UCX."""
    # a garbage address: UCX would abort the process if it were used
    with fake_receiver(b"\x0f" * 64) as address, pytest.raises(AuthenticationError, match="did not authenticate"):
        connect(address, timeout=5, config=TransportConfig(secret=SECRET))
