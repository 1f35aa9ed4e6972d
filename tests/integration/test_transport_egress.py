"""One Egress, two receivers ("decode nodes") in child processes, real UCX.

The egress (this process) shapes the node's link as a whole; an anchor for one
receiver overtakes a residual saturating the link for the other (within the
issue's bound, ``1.1 x (anchor bytes / rate) + one in-flight window``: a timing
check, marked ``timing``). A
receiver that dies, closes or goes silent mid-transfer fails only its own
streams: the other receiver's complete, byte-exact, and the egress forgets the
dead peer (``Egress.peers``) and keeps serving.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from lynx_transport import Egress, Lane, Rate, StreamState, TransportConfig
from lynx_transport.errors import ClosedError, PeerDisconnectedError, TransportError
from lynx_transport.testing import PeerProcess, pattern, prioritise_thread, receiver_server, wait_until

pytestmark = pytest.mark.ucx

MiB = 1 << 20
CHUNK = 256 * 1024
# quick failure detection for the silent-peer case (both sides use it)
CONFIG = TransportConfig(chunk_bytes=CHUNK, max_inflight_bytes=4 * CHUNK,
                         heartbeat_interval_s=0.1, peer_timeout_s=0.75)
GBPS = 1.0
RATE = Rate(GBPS, 4 * CHUNK)
POOL = 96 * MiB
PRIORITY = -10


def bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def prioritised_receiver(pipe, pool_bytes: int, config: TransportConfig) -> None:
    """Child side: :func:`receiver_server` with its threads at a raised priority (where
    permitted), like the egress here: millisecond timings should not depend on what
    else the box runs."""
    prioritise_thread(PRIORITY)
    receiver_server(pipe, pool_bytes, config)


def head(seed: int, n: int) -> str:
    """What ``receiver_server`` reports for a region: its first 16 bytes."""
    return bytes(pattern(seed, n)[:16]).hex()


@pytest.fixture
def receivers() -> Iterator[tuple[PeerProcess, PeerProcess, tuple, tuple]]:
    """Two receivers, each in a child process of its own (started in parallel)."""
    peers = [PeerProcess(prioritised_receiver, POOL, CONFIG) for _ in range(2)]
    try:
        addresses = [tuple(p.reply(60)) for p in peers]
        yield peers[0], peers[1], addresses[0], addresses[1]
    finally:
        for p in peers:
            p.close()


@pytest.fixture
def egress() -> Iterator[Egress]:
    # the egress's I/O thread at a raised priority (where permitted): a shaped link's
    # millisecond timings should not depend on what else the box runs
    before = prioritise_thread(PRIORITY)
    try:
        eg = Egress(CONFIG)
    finally:
        if before is not None:
            prioritise_thread(before)
    try:
        yield eg
    finally:
        eg.close()


def _overtaking(receivers, egress) -> tuple[float, float]:
    """A's anchor, then A's residual saturating the shaped link, then B's anchor to the other
    receiver; checks what landed and what the egress counted; (B's anchor latency from issue
    to LANE_DONE, the issue's bound on it)."""
    rx_a, rx_b, addr_a, addr_b = receivers
    egress.set_link_rate(RATE)
    a = egress.connect(addr_a, timeout=10)
    b = egress.connect(addr_b, timeout=10)
    assert egress.peers() == [addr_a, addr_b]
    anchor_a, residual_a, anchor_b = 1 * MiB, 64 * MiB, 16 * MiB
    sa = a.send_stream([("anc", pattern(1, anchor_a), Lane.ANCHOR),
                        ("res", pattern(2, residual_a), Lane.RESIDUAL)])
    sa.wait_lane(Lane.ANCHOR, 10)
    # A's residual saturates the shaped link ...
    assert wait_until(lambda: a.stats().lane(Lane.RESIDUAL).bytes >= 4 * MiB, 10)
    # ... when B's anchor is issued to the other receiver
    sb = b.send_stream([("anc", pattern(3, anchor_b), Lane.ANCHOR)])
    sb.wait_lane(Lane.ANCHOR, 10)
    latency = sb.lane_completed_at[Lane.ANCHOR] - sb.opened_at
    bound = 1.1 * anchor_b / bytes_per_s(GBPS) + CONFIG.max_inflight_bytes / bytes_per_s(GBPS)
    sa.wait(30)  # A's residual still completes
    sb.wait(10)
    assert sa.state is sb.state is StreamState.COMPLETED
    # B's anchor overtook: it completed while A's residual was still on the link
    assert sa.completed_at is not None and sb.lane_completed_at[Lane.ANCHOR] < sa.completed_at
    assert rx_a.call("next", 10) == {"anc": head(1, anchor_a), "res": head(2, residual_a)}
    assert rx_b.call("next", 10) == {"anc": head(3, anchor_b)}
    # the link is one for both peers: everything took at least total bytes / rate
    total = (anchor_a + residual_a + anchor_b) / bytes_per_s(GBPS)
    assert sa.started_at is not None
    assert sa.completed_at - sa.started_at >= 0.9 * total
    stats = egress.stats()
    assert stats.completed_streams == 2 and stats.active_streams == 0
    assert stats.lane(Lane.ANCHOR).bytes == anchor_a + anchor_b
    assert a.stats().lane(Lane.ANCHOR).bytes == anchor_a and b.stats().lane(Lane.RESIDUAL).bytes == 0
    return latency, bound


def test_an_anchor_for_one_receiver_overtakes_a_residual_saturating_the_link_for_another(
        receivers, egress) -> None:
    _overtaking(receivers, egress)


@pytest.mark.timing
def test_an_anchor_overtaking_a_saturating_residual_is_done_within_the_bound(receivers, egress, timing) -> None:
    latency, bound = _overtaking(receivers, egress)
    timing.at_most("B's anchor behind A's saturating residual, issue to LANE_DONE", latency, bound)


def _kill(peer: PeerProcess) -> None:
    peer.kill()


def _close(peer: PeerProcess) -> None:
    peer.close()  # the receiver closes: GOODBYE to its senders


def _sigstop(peer: PeerProcess) -> None:
    peer.signal(signal.SIGSTOP)  # silent: noticed after peer_timeout_s


FAULTS = {"killed": _kill, "closed": _close, "silent": _sigstop}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_dead_receiver_fails_only_its_own_streams_and_its_state_is_freed(
        receivers, egress, fault: str) -> None:
    rx_a, rx_b, addr_a, addr_b = receivers
    # a quarter of RATE: A's residual is on the link for ~0.7 s, long enough for the check
    # below to see it mid-transfer even when the test's thread is starved by other processes
    egress.set_link_rate(Rate(GBPS / 4, 4 * CHUNK))
    a = egress.connect(addr_a, timeout=10)
    b = egress.connect(addr_b, timeout=10)
    n_anchor, n_residual = 2 * MiB, 24 * MiB
    sa = a.send_stream([("anc", pattern(11, n_anchor), Lane.ANCHOR),
                        ("res", pattern(12, n_residual), Lane.RESIDUAL)])
    sa2 = a.send_stream([("res", pattern(13, n_residual), Lane.RESIDUAL)])
    sb = b.send_stream([("anc", pattern(21, n_anchor), Lane.ANCHOR),
                        ("res", pattern(22, n_residual), Lane.RESIDUAL)])
    # mid-transfer: A's residual is on the link, B's waits behind it (FIFO within the lane)
    assert wait_until(lambda: a.stats().lane(Lane.RESIDUAL).bytes >= 4 * MiB, 10)
    assert sa.state is StreamState.ACTIVE
    FAULTS[fault](rx_a)
    with pytest.raises(PeerDisconnectedError):
        sa.wait(10)
    if fault == "silent":
        rx_a.kill()  # declared dead by the egress; now really
    with pytest.raises(PeerDisconnectedError):
        sa2.wait(10)  # failed with its connection (the error says so, not a timeout)
    assert isinstance(a.broken, PeerDisconnectedError)
    assert egress.peers() == [addr_b]  # the dead peer is gone from the table ...
    assert a.stats().lane(Lane.RESIDUAL).queued_bytes == 0  # ... and from the scheduler
    assert a.stats().lane(Lane.RESIDUAL).inflight_bytes == 0
    with pytest.raises(PeerDisconnectedError):
        a.send_stream([("x", pattern(1, 1024), Lane.ANCHOR)])
    sb.wait(30)  # the other receiver's stream completes, byte-exact
    assert rx_b.call("next", 10) == {"anc": head(21, n_anchor), "res": head(22, n_residual)}
    # the egress keeps serving: a new stream, and a new connection to the live receiver
    b2 = egress.connect(addr_b, timeout=10)
    s = b2.send_stream([("anc", pattern(31, MiB), Lane.ANCHOR)])
    s.wait(10)
    assert rx_b.call("next", 10) == {"anc": head(31, MiB)}
    assert egress.peers() == [addr_b, addr_b]
    stats = egress.stats()
    assert stats.active_streams == 0 and stats.completed_streams == 2 and stats.failed_streams == 2
    assert all(lane.queued_bytes == lane.inflight_bytes == 0 for lane in stats.lanes)
    a.close()  # closing a broken connection is fine; closing a live one leaves the egress up
    b2.close()
    assert egress.peers() == [addr_b]


def test_closing_the_egress_closes_its_connections(receivers) -> None:
    _rx_a, _rx_b, addr_a, addr_b = receivers
    egress = Egress(CONFIG)
    a = egress.connect(addr_a, timeout=10)
    b = egress.connect(addr_b, timeout=10)
    egress.set_link_rate(Rate(0.1, CHUNK))
    s = a.send_stream([("res", pattern(1, 8 * MiB), Lane.RESIDUAL)])
    egress.close()
    egress.close()  # idempotent
    with pytest.raises(ClosedError):
        s.wait(5)
    assert isinstance(a.broken, ClosedError) and isinstance(b.broken, ClosedError)
    with pytest.raises(TransportError):
        b.send_stream([("x", pattern(1, 1024), Lane.ANCHOR)])
    with pytest.raises(ClosedError):
        egress.connect(addr_a, timeout=5)
    b.close()
