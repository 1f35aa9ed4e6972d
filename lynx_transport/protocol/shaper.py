"""Token-bucket shaping per lane and for the whole link (pure logic, injectable clock).

A :class:`TokenBucket` earns tokens at ``gbps`` (decimal Gbit/s) and holds at
most ``burst_bytes`` of them. A chunk may leave whenever the bucket is not in
debt (tokens >= 0); sending ``n`` bytes removes ``n`` tokens, so the balance may
go negative and the next chunk waits until the debt is repaid. Hence:

* the long-run rate is exact whatever the chunk size;
* at most ``burst_bytes`` plus one chunk leave back to back after an idle spell;
* a sender that wakes up late (timer jitter) loses nothing as long as it is
  late by less than ``burst_bytes / rate`` - the credit earned meanwhile is
  kept, up to the burst.

A :class:`Shaper` combines a link bucket, an optional peer-requested cap (the
receiver may ask the sender to hold a connection to a rate) and one bucket per
lane. A chunk may leave when *all* buckets that apply to it allow it. Rates
can be changed at any time; the bucket is first refilled at the old rate, so a
change takes effect from that instant.
"""

from __future__ import annotations

import dataclasses
import math

from lynx_transport.lanes import check_lane
from lynx_transport.protocol.clock import Clock

__all__ = ["Rate", "TokenBucket", "Shaper"]

# Float rounding: a bucket refilled for exactly the advertised delay may miss by
# a few ulps; a thousandth of a byte is far below anything measurable.
_EPSILON_BYTES = 1e-3


@dataclasses.dataclass(frozen=True)
class Rate:
    """A shaping rate: ``gbps`` decimal Gbit/s; up to ``burst_bytes`` of credit is kept while idle."""

    gbps: float
    burst_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if not (isinstance(self.gbps, (int, float)) and math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(f"rate must be a finite number of Gbit/s > 0, got {self.gbps!r}")
        if not isinstance(self.burst_bytes, int) or self.burst_bytes < 1:
            raise ValueError(f"burst_bytes must be an int >= 1, got {self.burst_bytes!r}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


class TokenBucket:
    """One token bucket. Not thread-safe: the owner serialises calls."""

    def __init__(self, rate: Rate, clock: Clock) -> None:
        self._clock = clock
        self._rate = rate
        self._tokens = float(rate.burst_bytes)
        self._last = clock.now()

    @property
    def rate(self) -> Rate:
        return self._rate

    @property
    def tokens(self) -> float:
        """Tokens available now (may be negative after a chunk larger than the burst)."""
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock.now()
        if now > self._last:
            self._tokens = min(
                float(self._rate.burst_bytes),
                self._tokens + (now - self._last) * self._rate.bytes_per_s,
            )
        self._last = max(self._last, now)

    def delay(self, nbytes: int) -> float:
        """Seconds from now until a chunk (of any size, e.g. ``nbytes``) may leave; 0.0 = now."""
        self._refill()
        if self._tokens >= -_EPSILON_BYTES:
            return 0.0
        return -self._tokens / self._rate.bytes_per_s

    def consume(self, nbytes: int) -> None:
        """Account for ``nbytes`` that left now."""
        self._refill()
        self._tokens -= nbytes

    def set_rate(self, rate: Rate) -> None:
        """Change the rate from now on (tokens earned so far are kept, capped at the new burst)."""
        self._refill()
        self._rate = rate
        self._tokens = min(self._tokens, float(rate.burst_bytes))


class Shaper:
    """Link, peer-cap and per-lane token buckets; ``None`` means unshaped."""

    def __init__(self, clock: Clock, link: Rate | None = None,
                 lanes: dict[int, Rate] | None = None) -> None:
        self._clock = clock
        self._link: TokenBucket | None = None
        self._peer: TokenBucket | None = None
        self._lanes: dict[int, TokenBucket] = {}
        self.set_link_rate(link)
        for lane, rate in (lanes or {}).items():
            self.set_lane_rate(lane, rate)

    @staticmethod
    def _update(bucket: TokenBucket | None, rate: Rate | None, clock: Clock) -> TokenBucket | None:
        if rate is None:
            return None
        if bucket is None:
            return TokenBucket(rate, clock)
        bucket.set_rate(rate)
        return bucket

    def set_link_rate(self, rate: Rate | None) -> None:
        """Shape the whole link to ``rate`` (``None``: unshaped)."""
        self._link = self._update(self._link, rate, self._clock)

    def set_peer_rate(self, rate: Rate | None) -> None:
        """The cap the receiver asked for (``None``: no cap); applies on top of the link rate."""
        self._peer = self._update(self._peer, rate, self._clock)

    def set_lane_rate(self, lane: int, rate: Rate | None) -> None:
        """Shape one lane to ``rate`` (``None``: unshaped)."""
        lane = check_lane(lane)
        bucket = self._update(self._lanes.get(lane), rate, self._clock)
        if bucket is None:
            self._lanes.pop(lane, None)
        else:
            self._lanes[lane] = bucket

    def rates(self) -> dict[str, Rate | None]:
        """Current configuration: ``{"link": ..., "peer": ..., "lane0": ..., ...}``."""
        out: dict[str, Rate | None] = {
            "link": self._link.rate if self._link else None,
            "peer": self._peer.rate if self._peer else None,
        }
        for lane, bucket in sorted(self._lanes.items()):
            out[f"lane{lane}"] = bucket.rate
        return out

    def lane_delay(self, lane: int, nbytes: int) -> float:
        """Seconds until the lane's own bucket lets ``nbytes`` go."""
        bucket = self._lanes.get(lane)
        return bucket.delay(nbytes) if bucket else 0.0

    def link_delay(self, nbytes: int) -> float:
        """Seconds until the link (and the peer cap) let ``nbytes`` go."""
        return max(self._link.delay(nbytes) if self._link else 0.0,
                   self._peer.delay(nbytes) if self._peer else 0.0)

    def delay(self, lane: int, nbytes: int) -> float:
        """Seconds until every bucket that applies lets ``nbytes`` on ``lane`` go."""
        return max(self.lane_delay(lane, nbytes), self.link_delay(nbytes))

    def consume(self, lane: int, nbytes: int) -> None:
        """Account for ``nbytes`` sent on ``lane`` now."""
        for bucket in (self._link, self._peer, self._lanes.get(lane)):
            if bucket is not None:
                bucket.consume(nbytes)
