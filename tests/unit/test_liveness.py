"""The control channel's shared rules, without UCX: peer liveness (``ControlSocket.keep_alive``,
used by both the sender's and the receiver's I/O loops, and the heartbeat thread,
``lynx_transport.ucx.heartbeat``) and the receiver's handshake steps."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from lynx_transport.errors import PeerDisconnectedError, ProtocolError
from lynx_transport.protocol import auth
from lynx_transport.protocol.clock import MonotonicClock
from lynx_transport.protocol.wire import (
    NONCE_BYTES,
    Frame,
    FrameDecoder,
    FrameType,
    HelloFlags,
    pack_hello,
    unpack_challenge,
)
from lynx_transport.ucx.control import ControlSocket
from lynx_transport.ucx.heartbeat import Heartbeats

SECRET = b"s" * 32


@pytest.fixture
def pair() -> Iterator[tuple[ControlSocket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:  # TCP: ControlSocket sets NODELAY
        b = socket.create_connection(server.getsockname())
        a, _ = server.accept()
    ctl = ControlSocket(a, 1 << 16, now=0.0)
    b.settimeout(1.0)
    try:
        yield ctl, b
    finally:
        ctl.close()
        b.close()


def frames(sock: socket.socket, expect: bool) -> list[FrameType]:
    """What arrived: wait (up to the socket's timeout) if a frame is expected, else look now."""
    if not expect:
        sock.setblocking(False)
    try:
        data = sock.recv(1 << 16)
    except BlockingIOError:
        return []
    finally:
        sock.settimeout(1.0)
    return [f.type for f in FrameDecoder(1 << 16).feed(data)]


def test_a_heartbeat_goes_out_when_this_side_was_silent_and_the_next_check_is_due(pair) -> None:
    ctl, peer = pair
    assert ctl.keep_alive(0.1, 0.25, 1.5) == pytest.approx(0.25)  # next heartbeat first
    assert frames(peer, expect=False) == []
    assert ctl.keep_alive(0.3, 0.25, 1.5) == pytest.approx(0.55)
    assert frames(peer, expect=True) == [FrameType.HEARTBEAT]
    assert ctl.last_tx == 0.3


def test_silence_past_the_timeout_loses_the_peer(pair) -> None:
    ctl, peer = pair
    peer.sendall(b"x")  # anything counts as a sign of life ...
    ctl.read(now=1.0)
    assert ctl.last_rx == 1.0
    ctl.keep_alive(2.4, 0.25, 1.5)
    with pytest.raises(PeerDisconnectedError, match="receiver .* silent for 1.60 s"):
        ctl.keep_alive(2.6, 0.25, 1.5, "receiver")


def test_a_byte_waiting_unread_is_a_sign_of_life(pair) -> None:
    """An I/O thread kept from running (a busy host) finds its peer's heartbeats waiting in
    the socket: that is life, not silence; the bytes stay there for ``read``."""
    ctl, peer = pair
    peer.sendall(b"x")
    ctl.keep_alive(5.0, 0.25, 1.5)  # no PeerDisconnectedError
    assert ctl.last_rx == 5.0
    assert ctl.sock.recv(1 << 16, socket.MSG_PEEK) == b"x"


def test_a_closed_socket_is_not_silence_but_a_disconnect(pair) -> None:
    ctl, peer = pair
    peer.close()
    with pytest.raises(PeerDisconnectedError, match="closed the control connection"):
        ctl.keep_alive(5.0, 0.25, 1.5)


def test_a_data_chunk_from_the_peer_is_a_sign_of_life(pair) -> None:
    ctl, _ = pair
    ctl.heard(1.2)
    ctl.keep_alive(2.6, 0.25, 1.5)
    with pytest.raises(PeerDisconnectedError, match="silent for 1.60 s"):
        ctl.keep_alive(2.8, 0.25, 1.5)


def test_heartbeat_if_due_sends_only_when_due_and_never_raises(pair) -> None:
    ctl, peer = pair
    ctl.heartbeat_if_due(0.1, 0.25)
    assert frames(peer, expect=False) == []
    ctl.heartbeat_if_due(0.3, 0.25)
    assert frames(peer, expect=True) == [FrameType.HEARTBEAT]
    assert ctl.last_tx == 0.3
    ctl.close()
    ctl.heartbeat_if_due(9.0, 0.25)  # a closed socket: nothing, no error


def test_the_heartbeat_thread_speaks_while_the_owner_does_nothing(pair) -> None:
    """Registered sockets get heartbeats from the thread alone; stop() ends it."""
    ctl, peer = pair
    beats = Heartbeats("lynx-test-heartbeat", MonotonicClock(), 0.05)
    ctl.last_tx = MonotonicClock().now()
    beats.add(ctl)
    beats.start()
    try:
        got: list[FrameType] = []
        while len(got) < 3:  # the peer's socket timeout (1 s) bounds each wait
            got += frames(peer, expect=True)
        assert set(got) == {FrameType.HEARTBEAT}
    finally:
        beats.stop()
    assert "lynx-test-heartbeat" not in [t.name for t in threading.enumerate()]
    beats.discard(ctl)


def hello(flags: HelloFlags, nonce: bytes = b"n" * NONCE_BYTES) -> Frame:
    return Frame(FrameType.HELLO, pack_hello(flags, nonce))


def test_receiver_steps_without_a_secret() -> None:
    assert auth.receiver_step(None, None, hello(HelloFlags.NONE)).welcome
    assert auth.receiver_step(None, None, hello(HelloFlags.AUTH)).welcome
    with pytest.raises(ProtocolError, match="must be HELLO"):
        auth.receiver_step(None, None, Frame(FrameType.OPEN, b""))


def test_receiver_steps_with_a_secret() -> None:
    nonce_s = b"n" * NONCE_BYTES
    assert "requires a shared secret" in (auth.receiver_step(SECRET, None, hello(HelloFlags.NONE))
                                          .deny or "")
    step = auth.receiver_step(SECRET, None, hello(HelloFlags.AUTH, nonce_s))
    assert step.challenge is not None and step.challenge[0] == nonce_s and not step.welcome
    nonce_r, mac = unpack_challenge(step.challenge_payload)
    assert nonce_r == step.challenge[1]
    assert auth.verify(auth.receiver_mac(SECRET, nonce_s, nonce_r), mac)
    proof = Frame(FrameType.PROOF, auth.sender_mac(SECRET, nonce_r, nonce_s))
    assert auth.receiver_step(SECRET, step.challenge, proof).welcome
    wrong = Frame(FrameType.PROOF, auth.sender_mac(b"t" * 32, nonce_r, nonce_s))
    assert auth.receiver_step(SECRET, step.challenge, wrong).deny == "wrong shared secret"
    # a second HELLO, or anything else, before the proof is refused
    assert auth.receiver_step(SECRET, step.challenge, hello(HelloFlags.AUTH)).deny
    assert auth.receiver_step(SECRET, None, Frame(FrameType.OPEN, b"")).deny
