"""Fuzzing the receiver with mutations of real captured control frames and manifests.

A real session (secret + per-chunk checksums, two lanes, metadata, a cancelled
stream) runs through a recording relay; its frames are the seed corpus.
Hypothesis then mutates them (bit flips, byte overwrites, truncation,
insertion, integer splices at any offset, frame reordering) and drives:

* the pure decoders (frame decoder, manifest, every payload unpacker), with
  the allocation they make bounded independently of any claimed size;
* a live :class:`Receiver` through a raw authenticated connection, plus UCX
  data chunks of arbitrary size and index for the streams it accepts.

After every case: only Lynx errors were raised, the receiver's I/O thread is
alive, no byte outside an accepted stream's regions changed (the pool is
filled with guard bytes), every completed stream holds exactly the bytes sent
for it, and once the connection is gone the pool is entirely free.

The default run takes ~200 cases; ``-m slow`` runs >= 10,000.
"""

from __future__ import annotations

import dataclasses
import selectors
import socket
import struct
import threading
import time
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx_transport import Lane, ReceivePool, Receiver, StreamState, TransportConfig, connect
from lynx_transport.errors import LynxError
from lynx_transport.protocol import wire
from lynx_transport.protocol.manifest import ManifestLimits, decode_manifest
from lynx_transport.protocol.pool import ALIGNMENT
from lynx_transport.protocol.wire import Frame, FrameDecoder, FrameType, encode_frame
from lynx_transport.testing import RawDataPath, RawPeer, pattern

pytestmark = pytest.mark.ucx

SECRET = b"fuzzing secret, 32 bytes long..."
CHUNK = 4096
LIMITS = ManifestLimits(max_regions=16, max_metadata_bytes=1024, max_total_bytes=1 << 20,
                        max_chunks=512)
CONFIG = TransportConfig(chunk_bytes=CHUNK, max_inflight_bytes=64 * 1024, secret=SECRET,
                         verify_chunks=True, manifest_limits=LIMITS, pool_wait_s=0.0,
                         handshake_timeout_s=0.5)  # a truncated HELLO costs 0.5 s, not 1.5
POOL_BYTES = 2 << 20
GUARD = 0xA5
DEFAULT_CASES = 200
SLOW_CASES = 10_000


# -- capture ---------------------------------------------------------------------
class Relay:
    """Forwards one TCP connection to ``target`` and records both directions."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listen = socket.create_server(("127.0.0.1", 0))
        self.address = self.listen.getsockname()
        self.to_receiver = bytearray()
        self.to_sender = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        a, _ = self.listen.accept()
        b = socket.create_connection(self.target)
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, (b, self.to_receiver))
        sel.register(b, selectors.EVENT_READ, (a, self.to_sender))
        with a, b, sel:
            while True:
                for key, _ in sel.select(5):
                    peer, log = key.data
                    try:
                        data = key.fileobj.recv(1 << 16)
                    except ConnectionResetError:
                        return  # a side closed with unread data: the capture is over
                    if not data:
                        return
                    log += data
                    try:
                        peer.sendall(data)
                    except (BrokenPipeError, ConnectionResetError):
                        return

    def close(self) -> None:
        self.thread.join(10)
        self.listen.close()


@dataclasses.dataclass(frozen=True)
class Corpus:
    to_receiver: tuple[Frame, ...]
    to_sender: tuple[Frame, ...]

    def of(self, ftype: FrameType) -> list[Frame]:
        return [f for f in self.to_receiver + self.to_sender if f.type is ftype]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    pool = ReceivePool(8 << 20)
    with Receiver(pool, config=CONFIG) as rx:
        relay = Relay(rx.address)
        with connect(relay.address, timeout=10, config=CONFIG) as conn:
            s = conn.send_stream([("k", pattern(1, 3 * CHUNK + 5), Lane.ANCHOR),
                                  ("v", pattern(2, 2 * CHUNK), Lane.RESIDUAL),
                                  ("e", b"", Lane.RESIDUAL)], metadata=b"layout v1")
            stream = rx.next_stream(10)
            s.wait(10)
            stream.release()
            c = conn.open_stream([("later", 4 * CHUNK, Lane.RESIDUAL)])
            rx.next_stream(10)  # accepted
            c.cancel()
            c.wait  # noqa: B018 - ends cancelled
            deadline = time.monotonic() + 5
            while not c.state.terminal and time.monotonic() < deadline:
                time.sleep(0.01)
        relay.close()
    to_r = tuple(f for f in FrameDecoder(1 << 20).feed(bytes(relay.to_receiver)))
    to_s = tuple(f for f in FrameDecoder(1 << 20).feed(bytes(relay.to_sender)))
    kinds = {f.type for f in to_r + to_s}
    assert {FrameType.HELLO, FrameType.CHALLENGE, FrameType.PROOF, FrameType.WELCOME,
            FrameType.OPEN_SENT, FrameType.ACCEPT, FrameType.CHUNK_SUM, FrameType.LANE_DONE,
            FrameType.STREAM_DONE, FrameType.CANCEL} <= kinds, kinds
    return Corpus(to_r, to_s)


# -- mutations ----------------------------------------------------------------------
INTERESTING = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF,
               1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with 0..4 random mutations."""
    b = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "set", "trunc", "insert", "splice", "delete"]))
        pos = draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and b:
            b[pos] = draw(st.integers(0, 255))
        elif op == "trunc":
            del b[pos:]
        elif op == "insert":
            b[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and b:
            del b[pos:pos + draw(st.integers(1, 8))]
        elif op == "splice":
            width = draw(st.sampled_from([1, 2, 4, 8]))
            value = draw(st.sampled_from(INTERESTING)) & ((1 << (8 * width)) - 1)
            b[pos:pos + width] = value.to_bytes(width, "big")
    return bytes(b)


def frame_bytes(f: Frame) -> bytes:
    return encode_frame(f.type, f.payload)


# -- pure decoders ------------------------------------------------------------------
UNPACKERS = {
    FrameType.HELLO: wire.unpack_hello, FrameType.WELCOME: wire.unpack_welcome,
    FrameType.CHALLENGE: wire.unpack_challenge, FrameType.PROOF: wire.unpack_proof,
    FrameType.ACCEPT: wire.unpack_stream_token, FrameType.REJECT: wire.unpack_stream_text,
    FrameType.LANE_DONE: wire.unpack_stream_lane, FrameType.STREAM_DONE: wire.unpack_u64,
    FrameType.CANCEL: wire.unpack_u64, FrameType.STREAM_FAILED: wire.unpack_stream_text,
    FrameType.RATE: wire.unpack_rate, FrameType.CHUNK_SUM: wire.unpack_chunk_sum,
    FrameType.DENIED: wire.unpack_stream_text,
    FrameType.OPEN: lambda p: decode_manifest(p, LIMITS),
    FrameType.OPEN_SENT: lambda p: decode_manifest(p, LIMITS),
}


def check_decoders(corpus: Corpus, data) -> None:
    frames = corpus.to_receiver + corpus.to_sender
    picked = data.draw(st.lists(st.sampled_from(frames), min_size=1, max_size=4))
    raw = data.draw(mutated(b"".join(frame_bytes(f) for f in picked)))
    f = data.draw(st.sampled_from(frames))
    payload = data.draw(mutated(f.payload))
    tracemalloc.start()
    try:
        try:
            for f in FrameDecoder(LIMITS.max_encoded_bytes).feed(raw):
                if isinstance(f, Frame) and f.type in UNPACKERS:
                    try:
                        UNPACKERS[f.type](f.payload)
                    except LynxError:
                        pass
        except LynxError:
            pass
        # payloads alone, mutated, through their unpacker
        try:
            UNPACKERS.get(f.type, bytes)(payload)  # HEARTBEAT, GOODBYE: payload ignored
        except LynxError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # nothing proportional to a claimed size: a few times what actually arrived
    assert peak < 64 * 1024 + 8 * (len(raw) + len(payload)), peak


@settings(max_examples=DEFAULT_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_decoders_raise_only_lynx_errors_and_allocate_nothing_proportional(corpus, data) -> None:
    check_decoders(corpus, data)


@pytest.mark.slow
@settings(max_examples=SLOW_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_decoders_fuzz_at_scale(corpus, data) -> None:
    check_decoders(corpus, data)


# -- a live receiver ----------------------------------------------------------------
class Target:
    """A receiver with a guard-filled pool."""

    def __init__(self) -> None:
        self.pool = ReceivePool(POOL_BYTES)
        self.pool.view(0, POOL_BYTES)[:] = GUARD
        self.rx = Receiver(self.pool, config=CONFIG)

    def connections(self) -> int:
        """Control connections the receiver still holds (it has not seen our close yet)."""
        return self.rx._call(lambda: len(self.rx._loop.conns))

    def drain(self) -> list:
        """Every stream opened since the last call."""
        out = []
        while True:
            try:
                out.append(self.rx.next_stream(0))
            except LynxError:
                return out


@pytest.fixture(scope="module")
def target():
    t = Target()
    yield t
    t.rx.close()


@st.composite
def data_plan(draw) -> list[tuple[int, int, int, str]]:
    """Chunks to send: (which accepted stream, chunk index, size, checksum: none/right/claims-full)."""
    return draw(st.lists(st.tuples(
        st.integers(0, 7), st.integers(0, 8),
        st.sampled_from([0, 1, 5, CHUNK - 1, CHUNK, CHUNK + 1]),
        st.sampled_from(["none", "right", "claims-full"])), min_size=0, max_size=6))


def send_data(raw: RawPeer, address: tuple[bytes, ...], tokens: dict[int, int],
              sent: dict[tuple[int, int], bytes], plan: list[tuple[int, int, int, str]]) -> None:
    """Chunks of arbitrary size and index, with or without (right or wrong) checksums."""
    streams = sorted(tokens.items())
    with RawDataPath(address) as path:
        for pick, index, n, checksum in plan:
            s, token = streams[pick % len(streams)]
            payload = pattern(index + 100, n)
            if checksum != "none":
                claimed = n if checksum == "right" else CHUNK
                raw.send(FrameType.CHUNK_SUM,
                         wire.pack_chunk_sum(s, index, claimed, zlib.crc32(payload)))
            sent.setdefault((token, index), bytes(payload))
            try:
                path.send(wire.chunk_tag(token, index), payload, timeout=2)
            except (LynxError, TimeoutError):
                pass


def run_receiver_case(corpus: Corpus, target: Target, data) -> None:
    sent: dict[tuple[int, int], bytes] = {}  # (token, chunk index) -> bytes sent
    tokens: dict[int, int] = {}  # stream id -> token
    try:
        drive(corpus, target, data, sent, tokens)
    except BaseException:
        for stream in settle(target):  # leave a clean receiver for the next case, report this one
            for r in stream.regions:
                target.pool.view(r.offset, r.nbytes)[:] = GUARD
            if stream.state is StreamState.COMPLETED:
                stream.release()
        raise
    check(target, sent, tokens)


def drive(corpus: Corpus, target: Target, data, sent: dict, tokens: dict) -> None:
    # everything is drawn first: what the receiver answers must not steer the draws
    candidates = [f for f in corpus.to_receiver if f.type not in (FrameType.HELLO, FrameType.PROOF)]
    fuzz_handshake = data.draw(st.booleans(), label="fuzz the handshake")
    if fuzz_handshake:
        hello = data.draw(mutated(frame_bytes(corpus.of(FrameType.HELLO)[0])))
        # a real PROOF, bound to another session's nonces
        proof = data.draw(mutated(frame_bytes(corpus.of(FrameType.PROOF)[0])))
    else:
        script = [data.draw(mutated(frame_bytes(f))) if data.draw(st.booleans()) else frame_bytes(f)
                  for f in data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=5))]
        plan = data.draw(data_plan(), label="data chunks")
    with RawPeer(target.rx.address, timeout=5) as raw:
        if fuzz_handshake:
            try:
                raw.send_raw(hello)
                raw.send_raw(proof)
            except OSError:
                pass
            frames = raw.drain_until_closed()
            assert FrameType.WELCOME not in {f.type for f in frames}, "welcomed without a proof"
            return
        address, *_ = wire.unpack_welcome(raw.handshake(SECRET).payload)
        try:
            for frame in script:
                raw.send_raw(frame)
            # a sentinel stream: its answer means every frame before it was handled
            sentinel = corpus.of(FrameType.OPEN_SENT)[0]  # the same manifest, sent as OPEN
            sid = (1 << 63) + 7
            raw.send(FrameType.OPEN, struct.pack("!Q", sid) + sentinel.payload[8:])
            answered = False
            # a mutated length can swallow the sentinel: then nothing more is handled
            raw.sock.settimeout(0.3)
            while not answered:
                for f in list(raw.frames):
                    if f.type is FrameType.ACCEPT:
                        s, token = wire.unpack_stream_token(f.payload)
                        tokens[s] = token
                    if f.type in (FrameType.ACCEPT, FrameType.REJECT) and \
                            struct.unpack_from("!Q", f.payload)[0] == sid:
                        answered = True
                if not answered and not raw._more():
                    break
            raw.sock.settimeout(5)
            if tokens and plan:
                send_data(raw, address, tokens, sent, plan)
        except (OSError, LynxError):
            pass  # the receiver dropped the connection: what we check is how it got there


def held(streams: list) -> int:
    """Pool bytes completed streams keep until their user releases them."""
    return sum(-(-max(r.nbytes, 1) // ALIGNMENT) * ALIGNMENT
               for st_ in streams if st_.state is StreamState.COMPLETED for r in st_.regions)


def settle(target: Target) -> list:
    """Wait (probe) until the receiver has seen the close and freed the pool; the streams opened."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and target.rx._loop.alive and (
            target.connections() or target.rx.stats().active_streams):
        time.sleep(0.005)
    opened = target.drain()  # queued synchronously before each ACCEPT went out
    while time.monotonic() < deadline and target.rx._loop.alive and (
            target.pool.free_bytes != POOL_BYTES - held(opened)):
        time.sleep(0.005)
    return opened


def check(target: Target, sent: dict, tokens: dict) -> None:
    # the connection is closed: every stream of it ends, the pool frees up
    assert target.rx._loop.alive, "the receiver's I/O thread died"
    opened = settle(target)
    assert target.rx.stats().active_streams == 0
    assert target.pool.free_bytes == POOL_BYTES - held(opened), "pool regions leaked"
    # guard bytes: nothing written outside the regions of accepted streams
    mask = np.ones(POOL_BYTES, dtype=bool)
    for stream in opened:
        for r in stream.regions:
            mask[r.offset:r.offset + r.nbytes] = False
    view = target.pool.view(0, POOL_BYTES)
    stray = np.flatnonzero(view[mask] != GUARD)
    where = np.flatnonzero(mask)[stray[:8]]
    assert stray.size == 0, (f"{stray.size} bytes written outside every accepted region "
                             f"at {where.tolist()} values {view[where].tolist()} "
                             f"(regions {[(r.offset, r.nbytes) for s in opened for r in s.regions]})")
    # no false completion: a completed stream holds exactly what was sent for it
    for stream in opened:
        if stream.state is not StreamState.COMPLETED:
            continue
        token = tokens.get(stream.stream_id)
        m = stream.manifest
        for r, first in zip(stream.regions, m.first_chunk_indices()):
            for k, off in enumerate(range(0, r.nbytes, m.chunk_bytes)):
                n = min(m.chunk_bytes, r.nbytes - off)
                got = bytes(view[r.offset + off:r.offset + off + n])
                assert token is not None and sent.get((token, first + k)) == got, \
                    f"stream {stream.stream_id} completed without its bytes"
    for stream in opened:
        for r in stream.regions:
            view[r.offset:r.offset + r.nbytes] = GUARD
        if stream.state is StreamState.COMPLETED:
            stream.release()  # the user's part: a completed stream keeps its memory until then
    assert target.pool.free_bytes == POOL_BYTES, "pool regions leaked"


@settings(max_examples=DEFAULT_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_receiver_survives_mutated_frames_without_stray_writes_or_false_completions(
        corpus, target, data) -> None:
    run_receiver_case(corpus, target, data)


@pytest.mark.slow
@settings(max_examples=SLOW_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_receiver_fuzz_at_scale(corpus, target, data) -> None:
    run_receiver_case(corpus, target, data)
