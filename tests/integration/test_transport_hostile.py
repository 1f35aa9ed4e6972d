"""A hostile or buggy sender on the data path: short, long, corrupted chunks and bad confirmations.

UCX does not report how many bytes a tagged receive got, so the receiver asks
for a CRC32 per chunk (``verify_chunks``) and counts a chunk only when the pool
bytes match it. These tests play the sender by hand (``RawPeer`` + ``RawDataPath``).
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import numpy as np
import pytest

from lynx_transport import Lane, ReceivePool, Receiver, StreamState, TransportConfig, connect
from lynx_transport.errors import ProtocolError
from lynx_transport.protocol.manifest import Manifest, ManifestLimits, RegionSpec, encode_manifest
from lynx_transport.protocol.wire import (
    FrameType,
    chunk_tag,
    pack_chunk_sum,
    unpack_stream_text,
    unpack_stream_token,
    unpack_welcome,
)
from lynx_transport.testing import RawDataPath, RawPeer, pattern

pytestmark = pytest.mark.ucx

CHUNK = 4096
# the raw peer sends no heartbeats: a silence limit far beyond any wait below
CONFIG = TransportConfig(chunk_bytes=CHUNK, max_inflight_bytes=64 * 1024, verify_chunks=True,
                         peer_timeout_s=60.0)


def open_stream(raw: RawPeer, sid: int, nbytes: int) -> int:
    m = Manifest(sid, CHUNK, (RegionSpec("r", nbytes, Lane.ANCHOR),))
    raw.send(FrameType.OPEN, encode_manifest(m, ManifestLimits()))
    got_sid, token = unpack_stream_token(raw.expect(FrameType.ACCEPT).payload)
    assert got_sid == sid
    return token


@dataclasses.dataclass
class Outcome:
    state: StreamState
    error: BaseException | None
    data: np.ndarray | None

    def exception(self) -> BaseException | None:
        return self.error


def run_case(chunks, sums, nbytes: int = 2 * CHUNK, settle: float = 30.0) -> Outcome:
    """Open one 2-chunk stream, send ``chunks`` [(index, bytes)] and ``sums`` [(index, n, crc)].

    Returns the receiver's stream (ended or not) and the pool, whose bytes outside
    the stream's region must stay untouched (guard bytes).
    """
    pool = ReceivePool(1 << 20)
    pool.view(0, pool.nbytes)[:] = 0xA5
    rx = Receiver(pool, config=CONFIG)
    try:
        with RawPeer(rx.address) as raw:
            address, *_ = unpack_welcome(raw.handshake().payload)
            token = open_stream(raw, 1, nbytes)
            stream = rx.next_stream(5)
            with RawDataPath(address) as data:
                for index, n, crc in sums:
                    raw.send(FrameType.CHUNK_SUM, pack_chunk_sum(1, index, n, crc))
                for index, payload in chunks:
                    data.send(chunk_tag(token, index), payload)
                try:
                    # until the stream ends (completed or failed), at most ``settle`` s; the
                    # raw peer sends no heartbeats, CONFIG.peer_timeout_s is well beyond that
                    stream.wait(settle)
                except Exception:
                    pass
            region = stream.regions[0]
            outside = np.concatenate([pool.view(0, region.offset),
                                      pool.view(region.offset + nbytes, pool.nbytes - region.offset - nbytes)])
            assert (outside == 0xA5).all(), "bytes written outside the stream's region"
            state = stream.state  # before closing the connection (which would fail the stream)
            return Outcome(state, stream.exception(), stream.view("r").copy() if
                           state is StreamState.COMPLETED else None)
    finally:
        rx.close()


def full(seed: int = 1) -> list[np.ndarray]:
    d = pattern(seed, 2 * CHUNK)
    return [d[:CHUNK], d[CHUNK:]]


def sums_of(parts) -> list[tuple[int, int, int]]:
    return [(i, p.nbytes, zlib.crc32(p)) for i, p in enumerate(parts)]


def test_verified_chunks_complete_when_every_checksum_matches() -> None:
    parts = full()
    stream = run_case(list(enumerate(parts)), sums_of(parts))
    assert stream.state is StreamState.COMPLETED
    assert np.array_equal(stream.data, np.concatenate(parts))


def test_a_short_chunk_is_never_counted_as_landed() -> None:
    parts = full()
    stream = run_case([(0, parts[0]), (1, parts[1][:100])], sums_of(parts))
    assert stream.state is StreamState.FAILED
    assert isinstance(stream.exception(), ProtocolError)
    assert "checksum" in str(stream.exception())


def test_a_short_chunk_with_a_matching_length_claim_still_fails() -> None:
    parts = full()
    short = parts[1][:100]
    stream = run_case([(0, parts[0]), (1, short)],
                      [sums_of(parts)[0], (1, CHUNK, zlib.crc32(short))])
    assert stream.state is StreamState.FAILED


def test_a_long_chunk_fails_the_stream() -> None:
    parts = full()
    stream = run_case([(0, parts[0]), (1, pattern(3, CHUNK + 1))], sums_of(parts))
    assert stream.state is StreamState.FAILED


def test_a_corrupted_chunk_fails_the_stream() -> None:
    parts = full()
    bad = parts[1].copy()
    bad[7] ^= 1
    stream = run_case([(0, parts[0]), (1, bad)], sums_of(parts))
    assert stream.state is StreamState.FAILED


def test_a_duplicate_checksum_fails_the_stream() -> None:
    parts = full()
    stream = run_case(list(enumerate(parts)), [sums_of(parts)[0]] * 2)
    assert stream.state is StreamState.FAILED
    assert "duplicate" in str(stream.exception())


def test_a_checksum_for_a_chunk_past_the_manifest_fails_the_stream() -> None:
    parts = full()
    stream = run_case(list(enumerate(parts)), [(2, CHUNK, 0)])
    assert stream.state is StreamState.FAILED
    assert "manifest has 2 chunks" in str(stream.exception())


def test_chunks_without_checksums_never_complete() -> None:
    stream = run_case(list(enumerate(full())), [], settle=1.0)  # a second to complete wrongly
    assert stream.state is StreamState.ACTIVE, stream.exception()


def test_a_checksum_repeated_after_completion_breaks_the_connection() -> None:
    parts = full()
    pool = ReceivePool(1 << 20)
    with Receiver(pool, config=CONFIG) as rx, RawPeer(rx.address) as raw:
        address, *_ = unpack_welcome(raw.handshake().payload)
        token = open_stream(raw, 1, 2 * CHUNK)
        stream = rx.next_stream(5)
        for index, n, crc in sums_of(parts):
            raw.send(FrameType.CHUNK_SUM, pack_chunk_sum(1, index, n, crc))
        with RawDataPath(address) as data:
            for index, payload in enumerate(parts):
                data.send(chunk_tag(token, index), payload)
            stream.wait(30)
        raw.expect(FrameType.STREAM_DONE)
        raw.send(FrameType.CHUNK_SUM, pack_chunk_sum(1, 0, CHUNK, 0))
        assert FrameType.STREAM_DONE not in [f.type for f in raw.drain_until_closed()]
        assert stream.state is StreamState.COMPLETED  # its bytes were verified before


def test_a_real_sender_sends_checksums_when_the_receiver_asks() -> None:
    pool = ReceivePool(8 << 20)
    with Receiver(pool, config=CONFIG) as rx, connect(rx.address, timeout=10, config=CONFIG) as conn:
        data = pattern(5, 100_000)
        s = conn.send_stream([("a", data, Lane.ANCHOR), ("b", data[::-1].copy(), Lane.RESIDUAL)])
        stream = rx.next_stream(10)
        s.wait(10)
        assert np.array_equal(stream.view("a"), data)
        assert np.array_equal(stream.view("b"), data[::-1])


def test_an_unsolicited_checksum_breaks_the_connection() -> None:
    with Receiver(ReceivePool(1 << 20), config=TransportConfig(chunk_bytes=CHUNK)) as rx, \
            RawPeer(rx.address) as raw:
        raw.handshake()
        raw.send(FrameType.CHUNK_SUM, pack_chunk_sum(1, 0, 1, 0))
        assert raw.drain_until_closed() == []


@pytest.mark.parametrize("lane, message", [(5, "does not use"), (0, "duplicate")])
def test_a_receivers_bogus_lane_confirmation_breaks_the_connection(lane: int, message: str) -> None:
    """A sender rejects LANE_DONE for a lane the stream does not use, or twice for one lane."""
    import socket
    import threading

    from lynx_transport.protocol.wire import (
        FrameDecoder,
        encode_frame,
        pack_stream_lane,
        pack_stream_token,
        pack_welcome,
    )
    from lynx_transport.ucx.adapter import UcxWorker

    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        done = threading.Event()

        def serve() -> None:
            worker = UcxWorker("^posix,sysv", "lo")  # a real address for the sender's endpoint
            conn, _ = fake.accept()
            with conn:
                decoder = FrameDecoder(1 << 20)
                conn.sendall(encode_frame(FrameType.WELCOME, pack_welcome(worker.address, 0.0, 0)))
                while not any(f.type is FrameType.OPEN for f in decoder.feed(conn.recv(65536))):
                    pass
                conn.sendall(encode_frame(FrameType.ACCEPT, pack_stream_token(1, 77)))
                conn.sendall(encode_frame(FrameType.LANE_DONE, pack_stream_lane(1, 0)))
                if lane == 0:
                    conn.sendall(encode_frame(FrameType.LANE_DONE, pack_stream_lane(1, 0)))
                else:
                    conn.sendall(encode_frame(FrameType.LANE_DONE, pack_stream_lane(1, lane)))
                while not done.wait(0.001):
                    worker.progress()  # answer the sender's UCX wire-up and close
            worker.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            with connect(fake.getsockname(), timeout=5, config=TransportConfig(chunk_bytes=CHUNK)) as conn:
                s = conn.open_stream([("a", 10, Lane.ANCHOR)])
                with pytest.raises(ProtocolError, match=message):
                    s.wait(5)
                assert s.state is StreamState.FAILED
                assert isinstance(conn.broken, ProtocolError)
        finally:
            done.set()
            t.join(10)


def test_a_receiver_abandons_a_residual_that_never_arrives() -> None:
    """The decode side's way out: copy the anchor, abandon the stream; never completed."""
    from lynx_transport.errors import StreamCancelledError, StreamFailedError, TransportTimeoutError

    pool = ReceivePool(8 << 20)
    cfg = TransportConfig(chunk_bytes=CHUNK)
    with Receiver(pool, config=cfg) as rx, connect(rx.address, timeout=10, config=cfg) as conn:
        anchor = pattern(7, 50_000)
        s = conn.open_stream([("a", anchor.nbytes, Lane.ANCHOR), ("r", 1 << 20, Lane.RESIDUAL)])
        s.supply("a", anchor)  # the residual is never supplied
        stream = rx.next_stream(10)
        stream.wait_lane(Lane.ANCHOR, 10)
        with pytest.raises(TransportTimeoutError):
            stream.wait_lane(Lane.RESIDUAL, 0.2)
        kept = stream.view("a").copy()
        stream.abandon("the residual missed its deadline")
        assert stream.state is StreamState.CANCELLED
        with pytest.raises(StreamCancelledError, match="abandoned by the receiver"):
            stream.wait(1)
        with pytest.raises(StreamFailedError, match="abandoned"):
            s.wait(5)  # the sender learns it
        assert np.array_equal(kept, anchor)
        stream.abandon("again")  # a no-op once finished
        deadline = time.monotonic() + 5
        while pool.free_bytes != pool.nbytes and time.monotonic() < deadline:
            time.sleep(0.01)  # probe: released after the quarantine
        assert pool.free_bytes == pool.nbytes
        data = pattern(8, 10_000)
        conn.send_stream([("b", data, Lane.ANCHOR)]).wait(10)  # the connection still works
        nxt = rx.next_stream(10)
        nxt.wait(10)
        assert np.array_equal(nxt.view("b"), data)


def test_a_stream_id_in_use_is_refused_without_touching_the_live_stream() -> None:
    """A plain OPEN that reuses a live stream's id gets REJECT (nothing of it is on its way);
    an OPEN_SENT that does is a protocol error (two streams' chunks under one tag cannot be
    told apart): the connection goes."""
    rx = Receiver(ReceivePool(1 << 20), config=CONFIG)
    try:
        with RawPeer(rx.address) as raw:
            raw.handshake()
            open_stream(raw, 1, 2 * CHUNK)
            stream = rx.next_stream(5)
            again = encode_manifest(Manifest(1, CHUNK, (RegionSpec("r", CHUNK, Lane.ANCHOR),)),
                                    ManifestLimits())
            raw.send(FrameType.OPEN, again)
            sid, _, text = unpack_stream_text(raw.expect(FrameType.REJECT).payload)
            assert (sid, text) == (1, "stream id 1 is already active")
            assert not stream.state.terminal
            raw.send(FrameType.OPEN_SENT, again)
            raw.drain_until_closed()  # the receiver drops the connection, and the stream with it
            with pytest.raises(ProtocolError, match="still in use"):
                stream.wait(10)
            assert stream.state is StreamState.FAILED
    finally:
        rx.close()
