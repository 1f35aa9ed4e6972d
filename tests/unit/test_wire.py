"""Control frames: round trips, strict header validation, bounded decoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_transport.errors import ProtocolError
from lynx_transport.protocol import wire
from lynx_transport.protocol.wire import WIRE_VERSION, FrameDecoder, FrameType, OversizedFrame, encode_frame


def decode_all(decoder: FrameDecoder, data: bytes, step: int) -> list:
    out = []
    for i in range(0, len(data), step):
        out.extend(decoder.feed(data[i:i + step]))
    return out


@settings(max_examples=50, deadline=None)
@given(frames=st.lists(st.tuples(st.sampled_from(list(FrameType)), st.binary(max_size=300)),
                       max_size=8),
       step=st.integers(1, 64))
def test_round_trip_in_arbitrary_pieces(frames: list[tuple[FrameType, bytes]], step: int) -> None:
    data = b"".join(encode_frame(t, p) for t, p in frames)
    got = decode_all(FrameDecoder(max_payload=1000), data, step)
    assert [(f.type, f.payload) for f in got] == frames


def test_truncated_frame_yields_nothing_until_complete() -> None:
    data = encode_frame(FrameType.HEARTBEAT, b"abc")
    dec = FrameDecoder(100)
    assert list(dec.feed(data[:-1])) == []
    assert [f.payload for f in dec.feed(data[-1:])] == [b"abc"]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b"XYNX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([WIRE_VERSION + 1]) + b[5:], "version"),
    (lambda b: b[:5] + bytes([99]) + b[6:], "frame type"),
    (lambda b: b[:6] + b"\x00\x01" + b[8:], "flags"),
])
def test_bad_header_is_a_protocol_error(mutate, message: str) -> None:
    data = mutate(encode_frame(FrameType.HELLO, b""))
    with pytest.raises(ProtocolError, match=message):
        list(FrameDecoder(100).feed(data))


def test_oversized_non_manifest_frame_is_fatal_without_buffering() -> None:
    header = wire.HEADER.pack(wire.WIRE_MAGIC, wire.WIRE_VERSION, FrameType.RATE, 0, 0xFFFFFFFF)
    dec = FrameDecoder(100)
    with pytest.raises(ProtocolError, match="exceeds"):
        list(dec.feed(header))


def test_oversized_manifest_is_skipped_and_the_next_frame_still_decodes() -> None:
    big = encode_frame(FrameType.OPEN, (42).to_bytes(8, "big") + b"x" * 5000)
    nxt = encode_frame(FrameType.HEARTBEAT, b"")
    dec = FrameDecoder(max_payload=100)
    got = decode_all(dec, big + nxt, 333)
    assert isinstance(got[0], OversizedFrame)
    assert got[0].length == 5008 and got[0].prefix == (42).to_bytes(8, "big")
    assert got[1].type is FrameType.HEARTBEAT
    assert len(dec._buf) == 0  # nothing of the big payload was kept


def test_small_payload_helpers_round_trip_and_reject_wrong_sizes() -> None:
    assert wire.unpack_stream_lane(wire.pack_stream_lane(5, 1)) == (5, 1)
    assert wire.unpack_stream_token(wire.pack_stream_token(5, 9)) == (5, 9)
    assert wire.unpack_stream_text(wire.pack_stream_text(5, 2, "no room")) == (5, 2, "no room")
    assert wire.unpack_rate(wire.pack_rate(1.5, 4096)) == (1.5, 4096)
    assert wire.unpack_welcome(wire.pack_welcome(b"addr", 0.0, 0)) == ((b"addr",), 0.0, 0,
                                                                      wire.WelcomeFlags.NONE, 0, 0)
    with pytest.raises(ProtocolError):
        wire.unpack_stream_lane(b"\x00" * 8)
    with pytest.raises(ProtocolError):
        wire.unpack_rate(wire.pack_rate(float("nan"), 1))
    with pytest.raises(ProtocolError):
        wire.unpack_stream_text(wire.pack_stream_text(5, 2, "abc")[:-1])


def test_welcome_lists_the_receive_rails_and_rejects_a_bad_list() -> None:
    addrs = (b"rail0", b"r1", b"rail-two")
    payload = wire.pack_welcome(addrs, 1.0, 4096, wire.WelcomeFlags.CHUNK_SUMS, 77, 1 << 20)
    assert wire.unpack_welcome(payload) == (addrs, 1.0, 4096,
                                            wire.WelcomeFlags.CHUNK_SUMS | wire.WelcomeFlags.RAILS,
                                            77, 1 << 20)
    head = 1 + 16 + 8  # flags + rate + connection key and OPEN_SENT limit
    for bad, why in [(payload[:-1], "does not match"), (payload + b"x", "trailing"),
                     (payload[:head] + bytes([1]) + payload[head + 1:], "addresses"),
                     (payload[:head] + bytes([wire.MAX_RAILS + 1]) + payload[head + 1:], "addresses"),
                     (payload[:head + 1] + b"\x00\x00" + payload[head + 3:], "does not match")]:
        with pytest.raises(ProtocolError, match=why):
            wire.unpack_welcome(bad)
    with pytest.raises(ProtocolError, match="1..8 worker addresses"):
        wire.pack_welcome([b"a"] * (wire.MAX_RAILS + 1), 0.0, 0)


def test_welcome_carries_a_connection_key_of_at_most_its_bits() -> None:
    top = (1 << wire.CONN_KEY_BITS) - 1
    assert wire.unpack_welcome(wire.pack_welcome(b"a", 0.0, 0, conn_key=top, max_open=9))[4:] == (top, 9)
    with pytest.raises(ProtocolError, match="bits"):
        wire.pack_welcome(b"a", 0.0, 0, conn_key=top + 1)
    bad = bytearray(wire.pack_welcome(b"a", 0.0, 0, conn_key=top))
    bad[1 + 16] = 0xFF  # the key's top byte: past its bits
    with pytest.raises(ProtocolError, match="bits"):
        wire.unpack_welcome(bytes(bad))


def test_tags_are_the_stream_token_and_the_chunk_index() -> None:
    token = wire.stream_token(5, 9)
    assert wire.conn_key_of(token) == 5
    assert wire.chunk_tag(token, 3) == (token << wire.CHUNK_BITS) | 3
    assert wire.chunk_tag(token, 3) < 1 << 64
    # the largest key and a stream id past the token's bits still make a 64-bit tag, and
    # streams of one connection 2**20 ids apart are the only ones that share a token
    top = wire.stream_token((1 << wire.CONN_KEY_BITS) - 1, (1 << 64) - 1)
    assert wire.chunk_tag(top, (1 << wire.CHUNK_BITS) - 1) == (1 << 64) - 1
    bits = 64 - wire.CHUNK_BITS - wire.CONN_KEY_BITS
    assert wire.stream_token(5, 9) == wire.stream_token(5, 9 + (1 << bits))
    assert wire.stream_token(5, 9) != wire.stream_token(6, 9)
    with pytest.raises(ProtocolError, match="chunk index"):
        wire.unpack_stream_token(wire.pack_stream_token(1, 1 << (64 - wire.CHUNK_BITS)))
