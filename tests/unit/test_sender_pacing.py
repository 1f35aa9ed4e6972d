"""The sender's pacing decision on a virtual clock: scheduler + shaper, driven the way the
I/O loop drives them (``SenderLoop.step`` / ``housekeeping``, ``IoLoop._run``).

Each round the loop hands UCX every chunk the scheduler gives, spends a little time on
the rest of its body, then asks ``wait_time()`` when to come back: at that deadline, or,
when it says ``None`` (nothing shaping can release), at the next UCX completion or, with
nothing in flight, at the next heartbeat. A rate raised mid-stream
(``Connection.set_link_rate``) used to make the stream slower than the old rate: with a
one-chunk burst the window drained at about the moment the bucket refilled, ``wait_time()``
saw the chunk ready and answered ``None`` ("only the in-flight bound holds it"), and the
loop slept until its next heartbeat (~0.2 s) with a ready chunk and nothing in flight.
"""

from __future__ import annotations

import pytest

from lynx_transport import Lane, Rate
from lynx_transport.protocol.clock import VirtualClock
from lynx_transport.protocol.scheduler import Chunk, PriorityScheduler
from lynx_transport.protocol.shaper import Shaper

KB = 1024
CHUNK = 256 * KB
HEARTBEAT_S = 0.25   # TransportConfig.heartbeat_interval_s: the loop's longest idle sleep
STEP_S = 50e-6       # the loop's own time between next_chunk() and wait_time()
LATENCY_S = 0.5e-3   # hand-off to UCX -> completion


def drive(sched: PriorityScheduler, clock: VirtualClock, change_after: int | None = None,
          new_rate: Rate | None = None, peer_shaper: Shaper | None = None) -> tuple[float, int]:
    """Run the loop until the queue is empty and nothing is in flight.

    Returns ``(seconds, idle_sleeps)``: the virtual time taken and how often the loop
    went to sleep until a heartbeat with a chunk queued and nothing in flight."""
    inflight: list[tuple[float, Chunk]] = []
    sent = 0
    idle_sleeps = 0
    start = clock.now()
    while True:
        now = clock.now()
        for entry in [e for e in inflight if e[0] <= now]:
            inflight.remove(entry)
            sched.complete(entry[1])
        while (chunk := sched.next_chunk()) is not None:
            inflight.append((clock.now() + LATENCY_S, chunk))
            sent += 1
            if change_after is not None and sent == change_after:
                assert peer_shaper is not None and new_rate is not None
                peer_shaper.set_link_rate(new_rate)
        clock.advance(STEP_S)
        queued = sum(sched.queued_bytes(lane) for lane in Lane)
        if not queued and not inflight:
            return clock.now() - start, idle_sleeps
        wait = sched.wait_time()
        if wait is not None:
            deadline = clock.now() + wait
        elif inflight:
            deadline = min(done for done, _ in inflight)  # UCX wakes the loop
        else:
            deadline = clock.now() + HEARTBEAT_S
            idle_sleeps += 1
        if inflight:
            deadline = min(deadline, min(done for done, _ in inflight))
        clock.advance(max(0.0, deadline - clock.now()))


def connection(gbps: float, burst: int, inflight_chunks: int) -> tuple[VirtualClock, PriorityScheduler, Shaper]:
    """One connection's scheduler, shaped by its own (per-peer) shaper as ``connect`` makes it."""
    clock = VirtualClock()
    sched = PriorityScheduler(clock, chunk_bytes=CHUNK, max_inflight_bytes=inflight_chunks * CHUNK)
    peer_shaper = Shaper(clock, link=Rate(gbps, burst))
    sched.add_peer(1, peer_shaper)
    return clock, sched, peer_shaper


def test_a_chunk_that_became_ready_is_0_not_none() -> None:
    clock, sched, _ = connection(4.0, CHUNK, 4)
    sched.add_region(1, 0, Lane.RESIDUAL, 8 * CHUNK, first_index=0, peer=1)
    sent = [sched.next_chunk(), sched.next_chunk()]          # the burst, then one on credit
    assert None not in sent and sched.next_chunk() is None  # the bucket is one chunk in debt
    for chunk in sent:
        sched.complete(chunk)  # type: ignore[arg-type]      # the window is empty again
    clock.advance(CHUNK / Rate(4.0).bytes_per_s + 1e-6)      # ... and the debt repaid meanwhile
    assert sched.wait_time() == 0.0                          # come back now, not at the heartbeat


def test_the_in_flight_bound_is_still_none() -> None:
    _, sched, _ = connection(4.0, 64 * CHUNK, 2)
    sched.add_region(1, 0, Lane.RESIDUAL, 8 * CHUNK, first_index=0, peer=1)
    assert sched.next_chunk() is not None and sched.next_chunk() is not None
    assert sched.next_chunk() is None
    assert sched.wait_time() is None  # ready, but only a completion makes room


@pytest.mark.parametrize("burst_chunks", [1, 4])
def test_raising_the_rate_mid_stream_speeds_the_stream_up(burst_chunks: int) -> None:
    """48 MiB at 0.5 Gbit/s, raised to 4 Gbit/s after the first 8 chunks (as
    tests/integration/test_transport_shaping.py does over UCX)."""
    nbytes = 48 * 1024 * KB
    old, new = Rate(0.5, burst_chunks * CHUNK), Rate(4.0, burst_chunks * CHUNK)
    clock, sched, peer_shaper = connection(old.gbps, old.burst_bytes, 4)
    sched.add_region(1, 0, Lane.RESIDUAL, nbytes, first_index=0, peer=1)
    seconds, idle_sleeps = drive(sched, clock, change_after=8, new_rate=new, peer_shaper=peer_shaper)
    assert idle_sleeps == 0
    # every chunk after the 8th at the new rate (the bursts only make it sooner)
    at_most = 8 * CHUNK / old.bytes_per_s + (nbytes - 8 * CHUNK) / new.bytes_per_s
    assert (nbytes - 8 * CHUNK - 2 * new.burst_bytes) / new.bytes_per_s <= seconds <= 1.05 * at_most
    assert seconds < 0.2 * nbytes / old.bytes_per_s


@pytest.mark.parametrize("gbps", [0.5, 1.0, 4.0, 10.0])
def test_the_loop_never_idles_with_a_ready_chunk(gbps: float) -> None:
    clock, sched, _ = connection(gbps, CHUNK, 4)
    sched.add_region(1, 0, Lane.RESIDUAL, 64 * CHUNK, first_index=0, peer=1)
    sched.add_region(2, 0, Lane.ANCHOR, 16 * CHUNK, first_index=0, peer=1)
    seconds, idle_sleeps = drive(sched, clock)
    assert idle_sleeps == 0
    assert seconds == pytest.approx(79 * CHUNK / Rate(gbps).bytes_per_s, rel=0.1)
