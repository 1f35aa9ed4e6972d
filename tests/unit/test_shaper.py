"""Token-bucket shaper driven by a virtual clock: burst, rate, rate changes, lanes vs link."""

from __future__ import annotations

import pytest

from lynx_transport.lanes import Lane
from lynx_transport.protocol.clock import VirtualClock
from lynx_transport.protocol.shaper import Rate, Shaper, TokenBucket


def drain(bucket: TokenBucket, clock: VirtualClock, chunk: int, total: int) -> float:
    """Send ``total`` bytes in ``chunk`` pieces as fast as the bucket allows; return elapsed."""
    start, sent = clock.now(), 0
    while sent < total:
        clock.advance(bucket.delay(chunk))
        assert bucket.delay(chunk) == 0.0
        bucket.consume(chunk)
        sent += chunk
    return clock.now() - start


def test_burst_leaves_immediately_then_rate_applies() -> None:
    clock = VirtualClock()
    bucket = TokenBucket(Rate(gbps=1.0, burst_bytes=1000), clock)
    # after an idle spell: the burst, plus one chunk on credit, leave back to back
    for _ in range(2):
        assert bucket.delay(1000) == 0.0
        bucket.consume(1000)
    # 1 Gbit/s = 125e6 B/s -> repaying 1000 bytes of debt takes 8 us
    assert bucket.delay(1000) == pytest.approx(8e-6)
    clock.advance(4e-6)
    assert bucket.delay(1000) == pytest.approx(4e-6)


def test_late_wakeup_within_the_burst_loses_no_rate() -> None:
    clock = VirtualClock()
    chunk = 1000
    bucket = TokenBucket(Rate(1.0, burst_bytes=chunk), clock)
    bucket.consume(2 * chunk)  # in debt by one chunk
    sent = 0
    for _ in range(1000):
        clock.advance(bucket.delay(chunk) + 0.9 * chunk / 125e6)  # always 90% of a chunk late
        bucket.consume(chunk)
        sent += chunk
    # ... yet the average rate holds, because the credit earned while late is kept
    assert sent / clock.now() == pytest.approx(125e6, rel=0.01)


@pytest.mark.parametrize("gbps", [0.5, 1.0, 4.0])
def test_long_run_rate_is_exact_even_with_chunks_larger_than_burst(gbps: float) -> None:
    clock = VirtualClock()
    chunk, burst, total = 1 << 20, 64 * 1024, 200 << 20
    bucket = TokenBucket(Rate(gbps, burst), clock)
    elapsed = drain(bucket, clock, chunk, total)
    # the first chunk takes the burst and the second goes on credit; after that
    # each chunk waits for the previous one's debt: the last starts once
    # (total - chunk - burst) bytes have been paid for at the rate
    ideal = (total - chunk - burst) / (gbps * 1e9 / 8)
    assert elapsed == pytest.approx(ideal, rel=1e-3)


def test_tokens_cap_at_burst_after_idle() -> None:
    clock = VirtualClock()
    bucket = TokenBucket(Rate(1.0, 5000), clock)
    bucket.consume(5000)
    clock.advance(10.0)
    assert bucket.tokens == 5000


def test_rate_change_mid_stream_takes_effect_from_that_instant() -> None:
    clock = VirtualClock()
    bucket = TokenBucket(Rate(1.0, 1), clock)
    bucket.consume(125_000_000)  # one second of debt at 1 Gbit/s
    clock.advance(0.5)  # half repaid at the old rate
    bucket.set_rate(Rate(2.0, 1))  # the other half at 2 Gbit/s: 0.25 s
    assert bucket.delay(1) == pytest.approx(0.25 + 1 / 250e6, rel=1e-6)


def test_shaper_link_holds_all_lanes_and_lane_rate_only_its_lane() -> None:
    clock = VirtualClock()
    shaper = Shaper(clock, link=Rate(8.0, 1000), lanes={Lane.RESIDUAL: Rate(1.0, 1000)})
    shaper.consume(Lane.RESIDUAL, 2000)  # 1000 bytes in debt on the lane and the link
    assert shaper.lane_delay(Lane.ANCHOR, 1000) == 0.0
    assert shaper.lane_delay(Lane.RESIDUAL, 1000) == pytest.approx(8e-6)
    assert shaper.link_delay(1000) == pytest.approx(1e-6)
    assert shaper.delay(Lane.ANCHOR, 1000) == pytest.approx(1e-6)
    shaper.set_lane_rate(Lane.RESIDUAL, None)
    assert shaper.delay(Lane.RESIDUAL, 1000) == pytest.approx(1e-6)


def test_peer_cap_applies_on_top_of_link() -> None:
    clock = VirtualClock()
    shaper = Shaper(clock, link=Rate(10.0, 1000))
    shaper.set_peer_rate(Rate(1.0, 1000))
    shaper.consume(Lane.ANCHOR, 2000)
    assert shaper.link_delay(1000) == pytest.approx(8e-6)
    assert shaper.rates()["peer"] == Rate(1.0, 1000)
    shaper.set_peer_rate(None)
    assert shaper.link_delay(1000) == pytest.approx(0.8e-6)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_rate_rejects_nonsense(bad: float) -> None:
    with pytest.raises(ValueError):
        Rate(bad)
    with pytest.raises(ValueError):
        Rate(1.0, 0)
