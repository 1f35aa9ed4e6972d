"""Shared-secret handshake: the pure MAC logic and its wire payloads."""

from __future__ import annotations

import pytest

from lynx_transport import TransportConfig
from lynx_transport.errors import ProtocolError
from lynx_transport.protocol import auth, wire

SECRET = b"s" * 32


def test_macs_are_direction_bound_and_verify_in_constant_time_helper() -> None:
    ns, nr = bytes(range(32)), bytes(range(32, 64))
    rx = auth.receiver_mac(SECRET, ns, nr)
    tx = auth.sender_mac(SECRET, nr, ns)
    assert rx != tx  # a receiver's proof cannot be reflected as a sender's
    assert auth.verify(rx, auth.receiver_mac(SECRET, ns, nr))
    assert not auth.verify(rx, auth.receiver_mac(b"t" * 32, ns, nr))
    assert not auth.verify(rx, rx[:-1])
    assert not auth.verify(tx, auth.sender_mac(SECRET, ns, nr))  # nonces swapped


def test_secret_is_never_in_the_config_repr_and_must_be_long_enough() -> None:
    cfg = TransportConfig(secret=SECRET)
    assert "sss" not in repr(cfg) and "secret" not in repr(cfg)
    with pytest.raises(ValueError, match="secret"):
        TransportConfig(secret=b"short")
    with pytest.raises(ValueError, match="secret"):
        TransportConfig(secret="a string, not bytes" * 2)  # type: ignore[arg-type]


def test_handshake_payloads_round_trip_and_reject_bad_sizes_and_flags() -> None:
    nonce = bytes(32)
    assert wire.unpack_hello(wire.pack_hello(wire.HelloFlags.AUTH, nonce)) == (wire.HelloFlags.AUTH, nonce)
    with pytest.raises(ProtocolError, match="HELLO payload"):
        wire.unpack_hello(b"")
    with pytest.raises(ProtocolError, match="flags"):
        wire.unpack_hello(b"\x80" + nonce)
    assert wire.unpack_challenge(nonce + b"m" * 32) == (nonce, b"m" * 32)
    with pytest.raises(ProtocolError, match="CHALLENGE"):
        wire.unpack_challenge(nonce)
    with pytest.raises(ProtocolError, match="PROOF"):
        wire.unpack_proof(b"x" * 31)
    with pytest.raises(ProtocolError, match="WELCOME flags"):
        wire.unpack_welcome(b"\x80" + wire.pack_welcome(b"addr", 0.0, 0)[1:])
    assert wire.unpack_chunk_sum(wire.pack_chunk_sum(1, 2, 3, 4)) == (1, 2, 3, 4)
    with pytest.raises(ProtocolError, match="CHUNK_SUM"):
        wire.unpack_chunk_sum(b"\x00" * 19)


# -- CLI: the secret comes from a file or the environment, never from argv -----------
def _parse(argv: list[str]):
    import argparse

    from lynx_bench.nodes import generate, serve

    out = []
    for mod, extra in ((serve, []), (generate, ["--connect", ":1", "--prompt-file", "p",
                                                        "--json", "o.json"])):
        parser = argparse.ArgumentParser()
        mod.add_arguments(parser)
        out.append(parser.parse_args(extra + argv))
    return out


def test_cli_reads_the_secret_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from lynx_bench.common.node_args import SECRET_ENV, load_secret, transport_config
    from lynx_transport.errors import ConfigError

    monkeypatch.delenv(SECRET_ENV, raising=False)
    for args in _parse([]):
        assert load_secret(args) is None and transport_config(args).secret is None
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    monkeypatch.setenv(SECRET_ENV, "from the environment, long enough")
    for args in _parse(["--secret-file", str(path)]):
        assert transport_config(args).secret == SECRET  # the file wins, newline stripped
    for args in _parse([]):
        assert load_secret(args) == b"from the environment, long enough"
    monkeypatch.setenv(SECRET_ENV, "short")
    for args in _parse([]):
        with pytest.raises(ConfigError, match="at least 16 bytes") as err:
            load_secret(args)
        assert "short" not in str(err.value)
    for args in _parse(["--secret-file", str(tmp_path / "missing")]):
        with pytest.raises(ConfigError, match="cannot read"):
            load_secret(args)


def test_cli_has_no_option_that_takes_the_secret_itself() -> None:
    import argparse

    from lynx_bench.nodes import generate, serve

    for mod in (serve, generate):
        parser = argparse.ArgumentParser()
        mod.add_arguments(parser)
        flags = {o for a in parser._actions for o in a.option_strings}
        assert "--secret-file" in flags
        assert not {f for f in flags if "secret" in f} - {"--secret-file"}


def test_a_heartbeat_before_the_welcome_is_a_sign_of_life_not_an_error() -> None:
    # the sender's side of the handshake, against a receiver whose heartbeat came first
    import socket
    import threading

    from lynx_transport.protocol.clock import MonotonicClock
    from lynx_transport.ucx.connection import _handshake

    ours, theirs = socket.socketpair()

    def receiver() -> None:
        theirs.recv(1 << 16)  # HELLO
        theirs.sendall(wire.encode_frame(wire.FrameType.HEARTBEAT, b"")
                       + wire.encode_frame(wire.FrameType.WELCOME, wire.pack_welcome(b"addr", 0.0, 0)))

    thread = threading.Thread(target=receiver)
    thread.start()
    try:
        clock = MonotonicClock()
        addresses, rate, *_ = _handshake(ours, clock.now() + 10.0, clock, None)
        assert addresses == (b"addr",) and rate is None
    finally:
        thread.join(5)
        ours.close()
        theirs.close()
