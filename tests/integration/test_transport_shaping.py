"""Priority and shaping on a real two-process link, shaped by the sender's token buckets.

Buckets get a burst of a few chunks, so a sender descheduled for a few
milliseconds catches up instead of losing rate; Lynx's bucket lets its burst
plus one chunk go at once and then holds the rate, so the achieved rate is
``(bytes - burst - chunk) / T``, timed from the first chunk to the receiver's
confirmation of the last.

What the design guarantees is checked in the default run: strict lane priority
(the anchor lane completes first) and that a bucket is never beaten (the achieved
rate is at most the configured one: a busy machine only makes it slower). That the
configured rate is also reached (within 5 %), and how soon a lane completes, are
wall-clock checks, marked ``timing``: rates low enough (0.5-4 Gbit/s) and transfers
long enough (~1.2 s) that scheduling noise stays inside the tolerances.
"""

from __future__ import annotations

import pytest

from lynx_transport import Lane, Rate, ReceivePool, Receiver, TransportConfig
from lynx_transport.testing import PeerProcess, prioritise_thread, sender_server

pytestmark = pytest.mark.ucx

CHUNK = 256 * 1024
CONFIG = TransportConfig(chunk_bytes=CHUNK, max_inflight_bytes=4 * CHUNK)
MiB = 1 << 20
PRIORITY = -10


BURST = 16 * CHUNK
BULK_CHUNK = 1 * MiB
BULK_BURST = 8 * BULK_CHUNK
BULK_CONFIG = TransportConfig(chunk_bytes=BULK_CHUNK, max_inflight_bytes=8 * BULK_CHUNK)


def achieved_gbps(nbytes: int, burst: int, chunk: int, seconds: float) -> float:
    return (nbytes - burst - chunk) / seconds * 8 / 1e9


def open_link(config: TransportConfig, pool_bytes: int):
    """A receiver here and a sender in a child, both I/O threads at a raised priority
    (where permitted) so other work on a shared machine does not skew millisecond timings."""
    pool = ReceivePool(pool_bytes)
    before = prioritise_thread(PRIORITY)
    try:
        rx = Receiver(pool, config=config, on_stream_complete=lambda s: s.release())
    finally:
        if before is not None:
            prioritise_thread(before)
    peer = PeerProcess(sender_server, rx.address, config, PRIORITY)
    try:
        assert peer.reply(60) == "connected"
        yield rx, peer
    finally:
        peer.close()
        rx.close()


@pytest.fixture(scope="module")
def link():
    """256 KiB chunks: fine-grained interleaving for the priority tests."""
    yield from open_link(CONFIG, 128 * MiB)


@pytest.fixture(scope="module")
def bulk_link():
    """1 MiB chunks: fewer wake-ups per second for the rate-accuracy tests up to 4 Gbit/s."""
    yield from open_link(BULK_CONFIG, 640 * MiB)


def bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


ANCHOR_FIRST = (1.0, 16 * MiB, 64 * MiB)  # Gbit/s, anchor bytes, residual bytes


def _anchor_and_residual(link) -> dict:
    """Both lanes at once over a 1 Gbit/s link; the residual listed first: priority,
    not manifest order, decides."""
    _rx, peer = link
    gbps, anchor, residual = ANCHOR_FIRST
    peer.call("link_rate", (gbps, BURST))
    try:
        result = peer.call("send", [("res", residual, Lane.RESIDUAL, -1),
                                    ("anc", anchor, Lane.ANCHOR, -1)], b"", 30.0)
    finally:
        peer.call("link_rate", None)
    assert result["state"] == "completed", result  # the residual is not starved
    return result


def test_anchor_lane_completes_first_and_residual_is_not_starved(link) -> None:
    result = _anchor_and_residual(link)
    assert result["lane_s"][Lane.ANCHOR] < result["lane_s"][Lane.RESIDUAL], result
    # the bucket holds the link: both lanes' bytes past the burst take at least their time
    gbps, anchor, residual = ANCHOR_FIRST
    assert result["data_s"] >= (anchor + residual - BURST - CHUNK) / bytes_per_s(gbps), result


@pytest.mark.timing
def test_anchor_lane_completes_at_the_link_rate(link, timing) -> None:
    result = _anchor_and_residual(link)
    gbps, anchor, residual = ANCHOR_FIRST
    chunk_time = CHUNK / bytes_per_s(gbps)
    # timed from the first chunk on the link to the receiver's LANE_DONE
    timing.at_most("anchor lane, first chunk to LANE_DONE", result["lane_data_s"][Lane.ANCHOR],
                   1.1 * anchor / bytes_per_s(gbps) + chunk_time)
    timing.at_most("both lanes, first chunk to the last confirmation", result["data_s"],
                   1.1 * (anchor + residual) / bytes_per_s(gbps) + chunk_time)


def _shaped_bulk(bulk_link, gbps: float) -> float:
    """The rate (Gbit/s) a ~1.2 s bulk stream achieved over a link shaped to ``gbps``."""
    _rx, peer = bulk_link
    nbytes = int(bytes_per_s(gbps) * 1.2) // BULK_CHUNK * BULK_CHUNK
    peer.call("link_rate", (gbps, BULK_BURST))
    try:
        result = peer.call("send", [("bulk", nbytes, Lane.RESIDUAL, -1)], b"", 30.0)
    finally:
        peer.call("link_rate", None)
    assert result["state"] == "completed", result
    return achieved_gbps(nbytes, BULK_BURST, BULK_CHUNK, result["data_s"])


@pytest.mark.parametrize("gbps", [0.5, 1.0, 4.0])
def test_link_shaping_never_beats_the_configured_rate(bulk_link, gbps: float) -> None:
    achieved = _shaped_bulk(bulk_link, gbps)
    assert achieved <= 1.05 * gbps, (achieved, gbps)


@pytest.mark.timing
@pytest.mark.parametrize("gbps", [0.5, 1.0, 4.0])
def test_link_shaping_achieves_the_configured_rate_within_5_percent(bulk_link, gbps: float, timing) -> None:
    achieved = _shaped_bulk(bulk_link, gbps)
    timing.within(f"achieved rate over a {gbps:g} Gbit/s link", achieved, 0.95 * gbps, 1.05 * gbps, "Gbit/s")


def _lane_rate(link) -> dict:
    """A residual lane shaped to 1 Gbit/s and an unshaped anchor lane, both at once."""
    _rx, peer = link
    peer.call("lane_rate", Lane.RESIDUAL, (1.0, BURST))
    try:
        result = peer.call("send", [("res", 48 * MiB, Lane.RESIDUAL, -1),
                                    ("anc", 32 * MiB, Lane.ANCHOR, -1)], b"", 30.0)
    finally:
        peer.call("lane_rate", Lane.RESIDUAL, None)
    assert result["state"] == "completed"
    return result


def _residual_gbps(result: dict) -> float:
    """The residual's rate once the anchor was done (its lane alone on the link)."""
    lanes = result["lane_s"]
    return achieved_gbps(48 * MiB, BURST, CHUNK, lanes[Lane.RESIDUAL] - lanes[Lane.ANCHOR])


def test_lane_rate_shapes_only_its_lane(link) -> None:
    result = _lane_rate(link)
    lanes = result["lane_s"]
    assert lanes[Lane.ANCHOR] < lanes[Lane.RESIDUAL], result
    # the residual lane's bucket is never beaten: its bytes past the burst take at least their
    # time at the lane rate, counted from the stream's first chunk (a busy machine only adds)
    held = achieved_gbps(48 * MiB, BURST, CHUNK, result["lane_data_s"][Lane.RESIDUAL])
    assert held <= 1.05, (held, result)


@pytest.mark.timing
def test_lane_rate_shapes_only_its_lane_at_its_rate(link, timing) -> None:
    result = _lane_rate(link)
    # the unshaped anchor finishes far sooner than the residual could at its rate
    timing.less_than("the unshaped anchor lane", result["lane_s"][Lane.ANCHOR], 0.5 * 48 * MiB / bytes_per_s(1.0))
    # once the anchor is done the residual runs at its own lane rate
    timing.within("the residual lane, shaped to 1 Gbit/s", _residual_gbps(result), 0.9, 1.1, "Gbit/s")


def test_rate_change_mid_stream_takes_effect(link) -> None:
    rx, peer = link
    nbytes = 48 * MiB
    peer.call("link_rate", (0.5, CHUNK))
    sid = peer.call("start", [("bulk", nbytes, Lane.RESIDUAL, -1)], b"")
    rx.next_stream(30)  # the stream is open and running at 0.5 Gbit/s: speed the link up
    peer.call("link_rate", (4.0, CHUNK))
    result = peer.call("wait", sid, 30.0)
    peer.call("link_rate", None)
    assert result["state"] == "completed"
    assert result["total_s"] < 0.6 * nbytes / bytes_per_s(0.5), result


def _receiver_capped(link) -> float:
    """The rate (Gbit/s) of a 1 s stream from a sender the receiver asked for 1 Gbit/s."""
    rx, peer = link
    rx.request_rate(Rate(1.0, BURST))
    try:
        # the RATE frame travels on the control channel; probe until the sender applied it
        for _ in range(200):
            if peer.call("rates")["peer"] == (1.0, BURST):
                break
        assert peer.call("rates")["peer"] == (1.0, BURST)
        nbytes = int(bytes_per_s(1.0) * 1.0) // CHUNK * CHUNK
        result = peer.call("send", [("bulk", nbytes, Lane.RESIDUAL, -1)], b"", 30.0)
    finally:
        rx.request_rate(None)
    assert result["state"] == "completed", result
    return achieved_gbps(nbytes, BURST, CHUNK, result["data_s"])


def test_receiver_requested_rate_caps_the_sender(link) -> None:
    achieved = _receiver_capped(link)
    assert achieved <= 1.05, achieved


@pytest.mark.timing
def test_receiver_requested_rate_is_the_senders_rate(link, timing) -> None:
    timing.within("achieved rate under the receiver's 1 Gbit/s cap", _receiver_capped(link), 0.95, 1.05, "Gbit/s")
