"""Control-channel frames: versioned, length-prefixed, validated before any allocation.

Every control message travels as one frame::

    magic  b"LYNX"  4 bytes
    version         u8   (must be WIRE_VERSION)
    type            u8   (a FrameType)
    flags           u16  (must be 0)
    length          u32  payload bytes that follow

Bulk data never travels in frames: it goes over UCX tagged messages straight
into the receive pool (see :mod:`lynx_transport.ucx.receiver`). A chunk's tag is
:func:`chunk_tag` of its stream's token and its index; the token is
:func:`stream_token` of the connection's key (from WELCOME) and the stream id, so
a sender knows every tag before the receiver answers, and sends a stream's chunks
right behind its ``OPEN_SENT`` (no round trip before the first byte).

:class:`FrameDecoder` is incremental and bounded: the header is checked before
any payload is buffered, and a payload longer than ``max_payload`` is never
stored. An oversized ``OPEN`` (manifest) frame is skipped byte by byte and
reported as :class:`OversizedFrame` so the receiver can reject that one stream
and keep the connection; any other bad frame is a :class:`ProtocolError` after
which the connection cannot be resynchronised.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Iterator, Sequence

from lynx_transport.errors import ProtocolError

__all__ = [
    "WIRE_MAGIC", "WIRE_VERSION", "MAX_RAILS", "rail_of", "HEADER", "FrameType", "Frame", "OversizedFrame",
    "FrameDecoder", "encode_frame", "RejectReason",
    "pack_u64", "unpack_u64", "pack_stream_lane", "unpack_stream_lane",
    "pack_stream_token", "unpack_stream_token", "pack_stream_text", "unpack_stream_text",
    "pack_rate", "unpack_rate", "pack_welcome", "unpack_welcome",
    "NONCE_BYTES", "MAC_BYTES", "HelloFlags", "WelcomeFlags", "pack_hello", "unpack_hello",
    "pack_challenge", "unpack_challenge", "unpack_proof", "pack_chunk_sum", "unpack_chunk_sum",
    "CHUNK_BITS", "CONN_KEY_BITS", "stream_token", "conn_key_of", "chunk_tag",
]

WIRE_MAGIC = b"LYNX"
WIRE_VERSION = 2
HEADER = struct.Struct("!4sBBHI")
#: Bytes of an oversized frame's payload that are kept (enough for a stream id).
OVERSIZED_PREFIX = 8
MAX_TEXT = 1024
MAX_ADDRESS = 64 * 1024
#: Most receive rails (UCX workers) a receiver announces.
MAX_RAILS = 8


#: Low bits of a UCX tag: the chunk's index in its stream (``ManifestLimits.max_chunks`` fits).
CHUNK_BITS = 20
#: Bits of a connection's key (random, unique among the receiver's live connections).
CONN_KEY_BITS = 24
#: Bits of a stream id in its token: ids are unique and increasing per connection, so
#: two live streams of one connection share a token only 2**20 streams apart.
_STREAM_BITS = 64 - CHUNK_BITS - CONN_KEY_BITS


def stream_token(conn_key: int, stream_id: int) -> int:
    """The token of stream ``stream_id`` on the connection keyed ``conn_key``: the high
    bits of every tag of its chunks (:func:`chunk_tag`)."""
    return (conn_key << _STREAM_BITS) | (stream_id & ((1 << _STREAM_BITS) - 1))


def conn_key_of(token: int) -> int:
    """The connection key a token was made from (:func:`stream_token`)."""
    return token >> _STREAM_BITS


def chunk_tag(token: int, index: int) -> int:
    """The UCX tag of chunk ``index`` of the stream with ``token``."""
    return (token << CHUNK_BITS) | index


def rail_of(chunk_index: int, rails: int) -> int:
    """The receive rail chunk ``chunk_index`` of a stream travels on: its WELCOME address
    and the receiver's worker for it are the ``rails``-long list's entry at this index."""
    return chunk_index % rails


class FrameType(enum.IntEnum):
    """Control messages. S = sender, R = receiver."""

    HELLO = 1          # S->R  first frame on a connection
    WELCOME = 2        # R->S  receiver's UCX worker address, requested rate
    OPEN = 3           # S->R  a stream manifest
    ACCEPT = 4         # R->S  stream id, tag token: pool carved, receives posted
    REJECT = 5         # R->S  stream id, reason code, message
    LANE_DONE = 6      # R->S  stream id, lane: every byte of the lane is in place
    STREAM_DONE = 7    # R->S  stream id: every byte of the stream is in place
    CANCEL = 8         # S->R  stream id: the sender abandons the stream
    STREAM_FAILED = 9  # either  stream id, message
    HEARTBEAT = 10     # either  liveness when idle
    RATE = 11          # R->S  hold this connection to a rate (0 = no cap)
    GOODBYE = 12       # either  orderly close
    CHALLENGE = 13     # R->S  receiver nonce + receiver's proof of the shared secret
    PROOF = 14         # S->R  sender's proof of the shared secret
    DENIED = 15        # R->S  authentication refused (text); the receiver then closes
    CHUNK_SUM = 16     # S->R  stream id, chunk index, length, CRC32 of one chunk
    LANE_GO = 17       # R->S  stream id, lane: start sending a lane the sender holds
    OPEN_SENT = 18     # S->R  a stream manifest whose chunks follow at once (no ACCEPT awaited)


class HelloFlags(enum.IntFlag):
    """Bits of HELLO's flags byte."""

    NONE = 0
    AUTH = 1  # the sender holds a shared secret and expects a CHALLENGE


class WelcomeFlags(enum.IntFlag):
    """Bits of WELCOME's flags byte."""

    NONE = 0
    CHUNK_SUMS = 1  # the receiver wants a CHUNK_SUM frame for every chunk
    RAILS = 2       # the payload lists several UCX worker addresses (receive rails)


class RejectReason(enum.IntEnum):
    """Why a receiver refused a stream (carried by REJECT)."""

    MANIFEST = 1
    POOL_EXHAUSTED = 2
    CLOSED = 3


@dataclasses.dataclass(frozen=True)
class Frame:
    type: FrameType
    payload: bytes


@dataclasses.dataclass(frozen=True)
class OversizedFrame:
    """A frame whose payload exceeded the limit; only its first bytes were kept."""

    type: FrameType
    length: int
    prefix: bytes


def encode_frame(ftype: FrameType, payload: bytes = b"") -> bytes:
    """Header + payload, ready for the socket."""
    if len(payload) > 0xFFFFFFFF:
        raise ProtocolError(f"frame payload of {len(payload)} bytes does not fit the wire format")
    return HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(ftype), 0, len(payload)) + payload


class FrameDecoder:
    """Turns a byte stream into frames; raises :class:`ProtocolError` on a bad header."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._buf = bytearray()
        self._skip = 0  # bytes of an oversized payload still to discard

    def feed(self, data: bytes) -> Iterator[Frame | OversizedFrame]:
        """Consume ``data``; yield every complete frame it finishes."""
        self._buf += data
        while True:
            if self._skip:
                n = min(self._skip, len(self._buf))
                del self._buf[:n]
                self._skip -= n
                if self._skip:
                    return
            if len(self._buf) < HEADER.size:
                return
            magic, version, ftype, flags, length = HEADER.unpack_from(self._buf)
            if magic != WIRE_MAGIC:
                raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {WIRE_MAGIC!r}): "
                                    "the peer is not a Lynx transport")
            if version != WIRE_VERSION:
                raise ProtocolError(f"unsupported wire version {version} (this side speaks "
                                    f"{WIRE_VERSION}); upgrade the older peer")
            try:
                kind = FrameType(ftype)
            except ValueError:
                raise ProtocolError(f"unknown frame type {ftype}") from None
            if flags != 0:
                raise ProtocolError(f"frame flags must be 0 in wire version {WIRE_VERSION}, got {flags:#x}")
            if length > self.max_payload:
                if kind is not FrameType.OPEN:
                    raise ProtocolError(f"{kind.name} frame of {length} bytes exceeds the "
                                        f"{self.max_payload}-byte limit")
                if len(self._buf) < HEADER.size + min(length, OVERSIZED_PREFIX):
                    return
                prefix = bytes(self._buf[HEADER.size:HEADER.size + OVERSIZED_PREFIX])
                del self._buf[:HEADER.size]
                self._skip = length
                yield OversizedFrame(kind, length, prefix)
                continue
            if len(self._buf) < HEADER.size + length:
                return
            payload = bytes(self._buf[HEADER.size:HEADER.size + length])
            del self._buf[:HEADER.size + length]
            yield Frame(kind, payload)


# -- small payloads ---------------------------------------------------------------
_U64 = struct.Struct("!Q")
_STREAM_LANE = struct.Struct("!QB")
_STREAM_TOKEN = struct.Struct("!QQ")
_RATE = struct.Struct("!dQ")
_STREAM_CODE = struct.Struct("!QBH")


def _exact(st: struct.Struct, payload: bytes, what: str) -> tuple:
    if len(payload) != st.size:
        raise ProtocolError(f"{what} payload must be {st.size} bytes, got {len(payload)}")
    return st.unpack(payload)


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(payload: bytes, what: str = "frame") -> int:
    return _exact(_U64, payload, what)[0]


def pack_stream_lane(stream_id: int, lane: int) -> bytes:
    return _STREAM_LANE.pack(stream_id, lane)


def unpack_stream_lane(payload: bytes, what: str = "LANE_DONE") -> tuple[int, int]:
    return _exact(_STREAM_LANE, payload, what)


def pack_stream_token(stream_id: int, token: int) -> bytes:
    return _STREAM_TOKEN.pack(stream_id, token)


def unpack_stream_token(payload: bytes) -> tuple[int, int]:
    sid, token = _exact(_STREAM_TOKEN, payload, "ACCEPT")
    if token >> (64 - CHUNK_BITS):
        raise ProtocolError(f"ACCEPT token {token:#x} leaves no bits for the chunk index")
    return sid, token


def pack_stream_text(stream_id: int, code: int, text: str) -> bytes:
    raw = text.encode("utf-8", "replace")[:MAX_TEXT]
    return _STREAM_CODE.pack(stream_id, code, len(raw)) + raw


def unpack_stream_text(payload: bytes) -> tuple[int, int, str]:
    if len(payload) < _STREAM_CODE.size:
        raise ProtocolError(f"truncated stream message ({len(payload)} bytes)")
    stream_id, code, n = _STREAM_CODE.unpack_from(payload)
    if n > MAX_TEXT or len(payload) != _STREAM_CODE.size + n:
        raise ProtocolError("stream message text length does not match the frame")
    return stream_id, code, payload[_STREAM_CODE.size:].decode("utf-8", "replace")


def pack_rate(gbps: float, burst_bytes: int) -> bytes:
    return _RATE.pack(gbps, burst_bytes)


def unpack_rate(payload: bytes) -> tuple[float, int]:
    gbps, burst = _exact(_RATE, payload, "RATE")
    if not (gbps == 0.0 or 0.0 < gbps < 1e6) or (gbps > 0 and burst < 1):
        raise ProtocolError(f"bad RATE values gbps={gbps!r} burst={burst}")
    return gbps, burst


_ADDRESS_LEN = struct.Struct("!H")


_KEYS = struct.Struct("!II")


def pack_welcome(addresses: bytes | Sequence[bytes], gbps: float, burst_bytes: int,
                 flags: WelcomeFlags = WelcomeFlags.NONE, conn_key: int = 0,
                 max_open: int = 0) -> bytes:
    """WELCOME: flags, requested rate, the connection's key (:func:`stream_token`) and the
    largest ``OPEN_SENT`` payload taken (0: none, every stream waits for its ACCEPT), then
    the receiver's UCX worker address or, with several (``RAILS``), a count and
    length-prefixed addresses."""
    if not 0 <= conn_key < 1 << CONN_KEY_BITS:
        raise ProtocolError(f"a connection key has {CONN_KEY_BITS} bits, got {conn_key:#x}")
    addrs = [addresses] if isinstance(addresses, bytes) else list(addresses)
    if not 1 <= len(addrs) <= MAX_RAILS:
        raise ProtocolError(f"a WELCOME carries 1..{MAX_RAILS} worker addresses, got {len(addrs)}")
    if len(addrs) == 1:
        body = addrs[0]
    else:
        flags |= WelcomeFlags.RAILS
        body = bytes([len(addrs)]) + b"".join(_ADDRESS_LEN.pack(len(a)) + a for a in addrs)
    return bytes([int(flags)]) + _RATE.pack(gbps, burst_bytes) + _KEYS.pack(conn_key, max_open) + body


def unpack_welcome(payload: bytes) -> tuple[tuple[bytes, ...], float, int, WelcomeFlags, int, int]:
    """``(worker addresses, gbps, burst, flags, conn_key, max_open)``; every length is checked."""
    head = 1 + _RATE.size + _KEYS.size
    if len(payload) < head + 1 or len(payload) > head + MAX_ADDRESS:
        raise ProtocolError(f"WELCOME payload of {len(payload)} bytes is out of range")
    if payload[0] & ~int(WelcomeFlags.CHUNK_SUMS | WelcomeFlags.RAILS):
        raise ProtocolError(f"unknown WELCOME flags {payload[0]:#x}")
    flags = WelcomeFlags(payload[0])
    gbps, burst = unpack_rate(payload[1:1 + _RATE.size])
    conn_key, max_open = _KEYS.unpack_from(payload, 1 + _RATE.size)
    if conn_key >> CONN_KEY_BITS:
        raise ProtocolError(f"WELCOME connection key {conn_key:#x} has more than {CONN_KEY_BITS} bits")
    body = payload[head:]
    if not flags & WelcomeFlags.RAILS:
        return (body,), gbps, burst, flags, conn_key, max_open
    n, pos, addrs = body[0], 1, []
    if not 2 <= n <= MAX_RAILS:
        raise ProtocolError(f"WELCOME lists {n} worker addresses (2..{MAX_RAILS} with RAILS)")
    for _ in range(n):
        if pos + _ADDRESS_LEN.size > len(body):
            raise ProtocolError("truncated WELCOME address list")
        (length,) = _ADDRESS_LEN.unpack_from(body, pos)
        pos += _ADDRESS_LEN.size
        if length == 0 or pos + length > len(body):
            raise ProtocolError("WELCOME address length does not match the frame")
        addrs.append(body[pos:pos + length])
        pos += length
    if pos != len(body):
        raise ProtocolError("trailing bytes after the WELCOME address list")
    return tuple(addrs), gbps, burst, flags, conn_key, max_open


# -- handshake (see lynx_transport.protocol.auth) -------------------------------------
NONCE_BYTES = 32
MAC_BYTES = 32


def pack_hello(flags: HelloFlags, nonce: bytes) -> bytes:
    return bytes([int(flags)]) + nonce


def unpack_hello(payload: bytes) -> tuple[HelloFlags, bytes]:
    if len(payload) != 1 + NONCE_BYTES:
        raise ProtocolError(f"HELLO payload must be {1 + NONCE_BYTES} bytes, got {len(payload)}")
    if payload[0] & ~int(HelloFlags.AUTH):
        raise ProtocolError(f"unknown HELLO flags {payload[0]:#x}")
    return HelloFlags(payload[0]), payload[1:]


def pack_challenge(nonce: bytes, mac: bytes) -> bytes:
    return nonce + mac


def unpack_challenge(payload: bytes) -> tuple[bytes, bytes]:
    if len(payload) != NONCE_BYTES + MAC_BYTES:
        raise ProtocolError(f"CHALLENGE payload must be {NONCE_BYTES + MAC_BYTES} bytes, "
                            f"got {len(payload)}")
    return payload[:NONCE_BYTES], payload[NONCE_BYTES:]


def unpack_proof(payload: bytes) -> bytes:
    if len(payload) != MAC_BYTES:
        raise ProtocolError(f"PROOF payload must be {MAC_BYTES} bytes, got {len(payload)}")
    return payload


# -- chunk checksums ---------------------------------------------------------------
_CHUNK_SUM = struct.Struct("!QIII")


def pack_chunk_sum(stream_id: int, index: int, nbytes: int, crc: int) -> bytes:
    return _CHUNK_SUM.pack(stream_id, index, nbytes, crc)


def unpack_chunk_sum(payload: bytes) -> tuple[int, int, int, int]:
    """``(stream_id, chunk index, nbytes, crc32)``; ranges are checked against the manifest."""
    return _exact(_CHUNK_SUM, payload, "CHUNK_SUM")
