"""Two processes on loopback: byte-exact delivery, callbacks exactly once and after the data.

The receiver runs in the test process; the sender runs in a spawned child
(:class:`lynx_transport.testing.PeerProcess`) that forwards its traceback.
"""

from __future__ import annotations

import collections
import json
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx_transport import Lane, ReceivePool, Receiver, StreamState, TransportConfig
from lynx_transport.testing import PeerProcess, pattern, sender_server, wait_until

pytestmark = pytest.mark.ucx

CONFIG = TransportConfig(chunk_bytes=64 * 1024, max_inflight_bytes=256 * 1024)
POOL_BYTES = 64 << 20


class Recorder:
    """Records every callback; checks in the callback thread that the bytes are already there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[int, list[tuple]] = collections.defaultdict(list)
        self.problems: list[str] = []
        self.finished: dict[int, threading.Event] = collections.defaultdict(threading.Event)

    def expected(self, stream, name: str) -> np.ndarray:
        spec = json.loads(stream.metadata)[name]
        return pattern(spec["seed"], spec["nbytes"])

    def _log(self, stream, *event) -> None:
        with self.lock:
            self.events[stream.stream_id].append(event)

    def on_stream_open(self, stream) -> None:
        self._log(stream, "open", tuple((r.name, r.nbytes, r.lane) for r in stream.regions))

    def on_region(self, stream, region) -> None:
        if not np.array_equal(stream.view(region.name), self.expected(stream, region.name)):
            self.problems.append(f"stream {stream.stream_id} region {region.name}: "
                                 "bytes not in place when on_region fired")
        self._log(stream, "region", region.name)

    def on_lane_complete(self, stream, lane) -> None:
        for r in stream.regions:
            if r.lane == lane and not stream.region_done(r.name):
                self.problems.append(f"lane {lane} complete before region {r.name}")
        self._log(stream, "lane", int(lane))

    def on_stream_complete(self, stream) -> None:
        self._log(stream, "complete")
        self.finished[stream.stream_id].set()

    def on_stream_failed(self, stream, error) -> None:
        self._log(stream, "failed", repr(error))
        self.finished[stream.stream_id].set()


@pytest.fixture(scope="module")
def loopback():
    pool = ReceivePool(POOL_BYTES)
    rec = Recorder()
    rx = Receiver(pool, config=CONFIG, on_stream_open=rec.on_stream_open, on_region=rec.on_region,
                  on_lane_complete=rec.on_lane_complete, on_stream_complete=rec.on_stream_complete,
                  on_stream_failed=rec.on_stream_failed)
    peer = PeerProcess(sender_server, rx.address, CONFIG)
    try:
        assert peer.reply(60) == "connected"
        yield pool, rx, rec, peer
    finally:
        peer.close()
        rx.close()


def make_specs(regions: list[tuple[int, int]], seed: int) -> tuple[list, bytes]:
    specs = [(f"r{i}", n, lane, seed * 100 + i) for i, (n, lane) in enumerate(regions)]
    meta = json.dumps({name: {"nbytes": n, "seed": s} for name, n, _, s in specs}).encode()
    return specs, meta


def check_stream(pool, rx, rec, specs, timeout: float = 30.0) -> None:
    stream = rx.next_stream(timeout)
    stream.wait(timeout)
    assert rec.finished[stream.stream_id].wait(timeout)
    assert stream.state is StreamState.COMPLETED
    for name, n, _lane, seed in specs:
        view = stream.view(name)
        assert view.nbytes == n
        assert np.array_equal(view, pattern(seed, n)), f"region {name} differs"
        if n:
            # zero copy: the region's bytes live inside the pool
            assert pool.base_address <= view.ctypes.data < pool.base_address + pool.nbytes
    events = rec.events[stream.stream_id]
    assert events[0] == ("open", tuple((name, n, lane) for name, n, lane, _ in specs))
    assert sorted(e[1] for e in events if e[0] == "region") == sorted(s[0] for s in specs)
    assert sorted(e[1] for e in events if e[0] == "lane") == sorted({s[2] for s in specs})
    assert [e[0] for e in events].count("complete") == 1 and events[-1] == ("complete",)
    assert not any(e[0] == "failed" for e in events)
    assert not rec.problems, rec.problems
    stream.release()


_counter = iter(range(1, 1 << 30))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regions=st.lists(st.tuples(st.one_of(st.integers(0, 3000), st.integers(0, 3 << 20)),
                                  st.sampled_from([Lane.ANCHOR, Lane.RESIDUAL, 2])),
                        min_size=1, max_size=6))
def test_random_region_sets_arrive_byte_exact(loopback, regions) -> None:
    pool, rx, rec, peer = loopback
    specs, meta = make_specs(regions, next(_counter))
    result = peer.call("send", specs, meta, 30.0)
    assert result["state"] == "completed", result
    check_stream(pool, rx, rec, specs)


def test_many_streams_in_sequence(loopback) -> None:
    pool, rx, rec, peer = loopback
    for _ in range(40):
        specs, meta = make_specs([(100_000, Lane.ANCHOR), (300_000, Lane.RESIDUAL)], next(_counter))
        assert peer.call("send", specs, meta, 30.0)["state"] == "completed"
        check_stream(pool, rx, rec, specs)
    assert pool.free_bytes == pool.nbytes


def test_several_streams_concurrently(loopback) -> None:
    pool, rx, rec, peer = loopback
    batch = [make_specs([(500_000 + 7 * i, Lane.RESIDUAL), (200_000, Lane.ANCHOR)], next(_counter))
             for i in range(6)]
    done = threading.Event()
    results = []

    def send() -> None:
        results.extend(peer.call("send_many", batch, 60.0))
        done.set()

    t = threading.Thread(target=send)
    t.start()
    streams = [rx.next_stream(30) for _ in batch]
    for s in streams:
        s.wait(30)
        assert rec.finished[s.stream_id].wait(30)
        assert rec.events[s.stream_id][-1] == ("complete",)
    assert not rec.problems, rec.problems
    assert done.wait(60)
    t.join()
    assert [r["state"] for r in results] == ["completed"] * len(batch)
    by_names = {tuple(sorted((r.name, r.nbytes) for r in s.regions)): s for s in streams}
    for specs, _ in batch:
        s = by_names[tuple(sorted((name, n) for name, n, _, _ in specs))]
        for name, n, _, seed in specs:
            assert np.array_equal(s.view(name), pattern(seed, n))
    for s in streams:
        s.release()
    assert pool.free_bytes == pool.nbytes


def test_metadata_and_manifest_are_known_before_data(loopback) -> None:
    _pool, rx, rec, peer = loopback
    specs, meta = make_specs([(2 << 20, Lane.RESIDUAL), (1 << 20, Lane.ANCHOR)], next(_counter))
    peer.call("link_rate", (0.5, 64 * 1024))  # slow enough that the stream is open long before done
    try:
        stream_id = peer.call("start", specs, meta)
        stream = rx.next_stream(30)
        assert stream.stream_id == stream_id
        assert stream.metadata == meta
        assert [(r.name, r.nbytes, r.lane) for r in stream.regions] == [s[:3] for s in specs]
        assert stream.manifest.lanes == (Lane.ANCHOR, Lane.RESIDUAL)
        assert not stream.region_done("r0")
        stream.wait_lane(Lane.ANCHOR, 30)
        assert stream.region_done("r1")
        stream.wait(30)
        assert rec.finished[stream.stream_id].wait(30)
    finally:
        peer.call("link_rate", None)
    check_events = rec.events[stream.stream_id]
    kinds = [e[0] for e in check_events]
    # anchor lane before the residual region, stream completion last
    assert kinds.index("lane") < kinds.index("complete")
    assert check_events.index(("lane", 0)) < check_events.index(("region", "r0"))
    stream.release()


def test_regions_supplied_incrementally_arrive_in_supply_order(loopback) -> None:
    _pool, rx, rec, peer = loopback
    specs, meta = make_specs([(300_000, Lane.ANCHOR)] * 4, next(_counter))
    # ~50 ms per region: each region's last chunk lands polls apart from the next one's, even
    # on a loaded host (regions found complete in one poll are reported in manifest order)
    peer.call("link_rate", (0.05, 64 * 1024))
    try:
        result = peer.call("incremental", specs, meta, 30.0)
    finally:
        peer.call("link_rate", None)
    assert result["state"] == "completed", result
    stream = rx.next_stream(30)
    stream.wait(30)
    assert rec.finished[stream.stream_id].wait(30)
    regions = [e[1] for e in rec.events[stream.stream_id] if e[0] == "region"]
    assert regions == ["r3", "r2", "r1", "r0"]  # one lane: first supplied, first sent
    for name, n, _, seed in specs:
        assert np.array_equal(stream.view(name), pattern(seed, n))
    assert not rec.problems, rec.problems
    stream.release()


def test_thread_nice_lowers_the_transports_own_threads_only() -> None:
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(19, base + 3)  # a process already at 19 (`nice -n 19 make test`) cannot go lower
    rx = Receiver(ReceivePool(1 << 20), config=TransportConfig(thread_nice=3))
    try:
        nice: dict[str, int] = {}
        deadline = 50
        # the threads renice themselves as they start
        while (len(nice) < 2 or set(nice.values()) != {want}) and deadline:
            nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                    for t in threading.enumerate() if t.name in ("lynx-rx-io", "lynx-rx-callbacks")}
            deadline -= 1
            threading.Event().wait(0.02)
        assert nice == {"lynx-rx-io": want, "lynx-rx-callbacks": want}
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched
    finally:
        rx.close()


@pytest.mark.parametrize("bad", [40, -40, 1.5])
def test_thread_nice_out_of_range_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="thread_nice"):
        TransportConfig(thread_nice=bad)


def _residual_bytes(rx) -> int:
    return rx.stats().lane(Lane.RESIDUAL).bytes


def _held_stream(peer, rx, hold=(Lane.RESIDUAL,)):
    specs, meta = make_specs([(1 << 20, Lane.ANCHOR), (2 << 20, Lane.RESIDUAL)], next(_counter))
    sid = peer.call("start", specs, meta, tuple(hold))
    stream = rx.next_stream(30)
    assert stream.stream_id == sid
    return specs, stream


def _check_held_then_complete(rx, rec, stream, specs, release) -> None:
    before = _residual_bytes(rx)
    stream.wait_lane(Lane.ANCHOR, 30)
    threading.Event().wait(0.3)
    # the residual is held: not one byte of it moved while the receiver was busy
    assert not stream.region_done("r1")
    assert _residual_bytes(rx) == before
    release()
    stream.wait(30)
    assert rec.finished[stream.stream_id].wait(30)
    for name, n, _, seed in specs:
        assert np.array_equal(stream.view(name), pattern(seed, n))
    assert not rec.problems, rec.problems
    stream.release_lane(Lane.RESIDUAL)  # idempotent, also once the stream is finished
    stream.release()


def test_a_held_lane_waits_for_the_receivers_release(loopback) -> None:
    _pool, rx, rec, peer = loopback
    specs, stream = _held_stream(peer, rx)
    with pytest.raises(ValueError, match="no lane 3"):
        stream.release_lane(3)

    def release() -> None:
        stream.release_lane(Lane.RESIDUAL)
        stream.release_lane(Lane.RESIDUAL)  # twice: one LANE_GO is enough, the second is ignored

    _check_held_then_complete(rx, rec, stream, specs, release)


def test_a_held_lane_can_be_released_by_the_sender(loopback) -> None:
    _pool, rx, rec, peer = loopback
    specs, stream = _held_stream(peer, rx)
    _check_held_then_complete(rx, rec, stream, specs,
                              lambda: peer.call("release", stream.stream_id, int(Lane.RESIDUAL)))


def test_a_sender_can_wait_for_the_release_of_a_held_lane() -> None:
    """``SendStream.wait_released``: a prefill node encodes the residual only once
    the decode node asks for it."""
    from lynx_transport import connect
    from lynx_transport.errors import TransportError, TransportTimeoutError

    n = 1 << 20
    with Receiver(ReceivePool(16 << 20)) as rx, connect(rx.address, timeout=10) as conn:
        sent = conn.open_stream([("a", n, Lane.ANCHOR), ("r", n, Lane.RESIDUAL)],
                                hold=[Lane.RESIDUAL])
        sent.wait_released(Lane.ANCHOR, 0)  # not held: at once
        with pytest.raises(TransportTimeoutError, match="release of lane 1"):
            sent.wait_released(Lane.RESIDUAL, 0.2)
        sent.supply("a", pattern(1, n))
        incoming = rx.next_stream(10)
        incoming.wait_lane(Lane.ANCHOR, 10)
        assert not sent.lane_released_at
        incoming.release_lane(Lane.RESIDUAL)
        sent.wait_released(Lane.RESIDUAL, 10)
        assert Lane.RESIDUAL in sent.lane_released_at
        sent.supply("r", pattern(2, n))  # encoded after the release, sent at once
        sent.wait(10)
        assert np.array_equal(incoming.view("r"), pattern(2, n))
        incoming.release()

        # a stream that ends while its lane is held wakes the waiter with its error
        sent = conn.open_stream([("a", n, Lane.ANCHOR), ("r", n, Lane.RESIDUAL)],
                                hold=[Lane.RESIDUAL])
        incoming = rx.next_stream(10)
        threading.Timer(0.1, lambda: incoming.abandon("the decoder gave up")).start()
        with pytest.raises(TransportError, match="gave up"):
            sent.wait_released(Lane.RESIDUAL, 10)


def test_holding_a_lane_no_region_travels_on_is_refused(loopback) -> None:
    _pool, _rx, _rec, peer = loopback
    specs, meta = make_specs([(4096, Lane.ANCHOR)], next(_counter))
    with pytest.raises(Exception, match="cannot hold lanes \\[1\\]"):
        peer.call("start", specs, meta, (int(Lane.RESIDUAL),))


@pytest.mark.parametrize("rails", [1, 3])
def test_receive_rails_each_take_their_share_and_stop_with_the_receiver(rails) -> None:
    from lynx_transport.protocol.wire import unpack_welcome
    from lynx_transport.testing import RawPeer

    others = {t for t in threading.enumerate() if t.name.startswith("lynx-rx-rail")}

    def rail_threads() -> list[str]:  # this receiver's (other tests' receivers may be alive)
        return sorted(t.name for t in threading.enumerate()
                      if t.name.startswith("lynx-rx-rail") and t not in others)

    config = TransportConfig(chunk_bytes=64 * 1024, rails=rails)
    pool = ReceivePool(8 << 20)
    rx = Receiver(pool, config=config)
    try:
        assert rail_threads() == [f"lynx-rx-rail{i}" for i in range(1, rails)]
        with RawPeer(rx.address) as raw:  # the WELCOME lists one UCX worker per rail
            addresses, *_ = unpack_welcome(raw.handshake().payload)
            assert len(addresses) == rails
        # 2.5 MiB in 64 KiB chunks: every rail receives (chunk i on rail i % rails)
        specs, meta = make_specs([(5 << 19, Lane.RESIDUAL), (70_000, Lane.ANCHOR)], next(_counter))
        with PeerProcess(sender_server, rx.address, config) as peer:
            assert peer.reply(60) == "connected"
            assert peer.call("send", specs, meta, 30.0)["state"] == "completed"
        stream = rx.next_stream(10)
        stream.wait(10)
        for name, n, _, seed in specs:
            assert np.array_equal(stream.view(name), pattern(seed, n))
        stream.release()
    finally:
        rx.close()
    assert wait_until(lambda: not rail_threads(), 5)


def _thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used so far."""
    import time

    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _idle_io_cpu_s(busy_poll: bool) -> float:
    """CPU seconds an idle receiver's I/O thread uses over 0.5 s of wall clock."""
    others = set(threading.enumerate())  # a module fixture's receiver has an I/O thread too
    with Receiver(ReceivePool(1 << 20), config=TransportConfig(busy_poll=busy_poll, rails=1)):
        io = [t for t in threading.enumerate() if t.name == "lynx-rx-io" and t not in others]
        assert len(io) == 1, io
        before = _thread_cpu_s(io[0])
        threading.Event().wait(0.5)
        return _thread_cpu_s(io[0]) - before


def test_busy_poll_keeps_the_idle_io_thread_polling_and_the_default_sleeps() -> None:
    """The latency mode's cost, as its cause: an idle receiver's I/O thread polls on in
    latency mode (CPU time while nothing happens), and sleeps on UCX's fd without it. How
    much of a core it gets depends on the machine's load: `timing` checks that apart."""
    spent = {busy: _idle_io_cpu_s(busy) for busy in (False, True)}
    assert spent[True] > 5 * spent[False], spent


@pytest.mark.timing
def test_an_idle_busy_polling_io_thread_takes_a_share_of_a_core(timing) -> None:
    timing.at_least("an idle busy-polling receiver's I/O thread: CPU over 0.5 s (quiet: ~0.5 s)",
                    _idle_io_cpu_s(True), 0.05)


@pytest.mark.parametrize("name", ["busy_poll", "send_before_accept", "send_from_caller"])
@pytest.mark.parametrize("bad", [1, "yes", None])
def test_the_switches_must_be_bools(name: str, bad) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a bool"):
        TransportConfig(**{name: bad})
