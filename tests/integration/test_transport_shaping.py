"""Priority and shaping on a real two-process link, shaped by the sender's token buckets.

Rates are low enough (0.5-4 Gbit/s) and transfers long enough (~1.2 s) that
scheduling noise on a busy 2-core machine stays well inside the tolerances.
Buckets get a burst of a few chunks, so a sender descheduled for a few
milliseconds catches up instead of losing rate; Lynx's bucket lets its burst
plus one chunk go at once and then holds the rate, so the achieved rate is
``(bytes - burst - chunk) / T``, timed from the first chunk to the receiver's
confirmation of the last.
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


def test_anchor_lane_completes_first_at_link_rate_and_residual_is_not_starved(link) -> None:
    _rx, peer = link
    gbps, anchor, residual = 1.0, 16 * MiB, 64 * MiB
    peer.call("link_rate", (gbps, BURST))
    try:
        # residual listed first: priority, not manifest order, decides
        result = peer.call("send", [("res", residual, Lane.RESIDUAL, -1),
                                    ("anc", anchor, Lane.ANCHOR, -1)], b"", 30.0)
    finally:
        peer.call("link_rate", None)
    assert result["state"] == "completed", result
    ideal = anchor / bytes_per_s(gbps)
    chunk_time = CHUNK / bytes_per_s(gbps)
    # timed from the first chunk on the link to the receiver's LANE_DONE
    assert result["lane_data_s"][Lane.ANCHOR] <= 1.1 * ideal + chunk_time, result
    assert result["lane_s"][Lane.ANCHOR] < result["lane_s"][Lane.RESIDUAL]
    total_ideal = (anchor + residual) / bytes_per_s(gbps)
    assert result["data_s"] <= 1.1 * total_ideal + chunk_time, result


@pytest.mark.parametrize("gbps", [0.5, 1.0, 4.0])
def test_link_shaping_achieves_the_configured_rate_within_5_percent(bulk_link, gbps: float) -> None:
    _rx, peer = bulk_link
    nbytes = int(bytes_per_s(gbps) * 1.2) // BULK_CHUNK * BULK_CHUNK
    peer.call("link_rate", (gbps, BULK_BURST))
    try:
        result = peer.call("send", [("bulk", nbytes, Lane.RESIDUAL, -1)], b"", 30.0)
    finally:
        peer.call("link_rate", None)
    assert result["state"] == "completed", result
    achieved = achieved_gbps(nbytes, BULK_BURST, BULK_CHUNK, result["data_s"])
    assert abs(achieved / gbps - 1) <= 0.05, (achieved, gbps)


def test_lane_rate_shapes_only_its_lane(link) -> None:
    _rx, peer = link
    peer.call("lane_rate", Lane.RESIDUAL, (1.0, BURST))
    try:
        result = peer.call("send", [("res", 48 * MiB, Lane.RESIDUAL, -1),
                                    ("anc", 32 * MiB, Lane.ANCHOR, -1)], b"", 30.0)
    finally:
        peer.call("lane_rate", Lane.RESIDUAL, None)
    assert result["state"] == "completed"
    residual_ideal = 48 * MiB / bytes_per_s(1.0)
    # the unshaped anchor finishes far sooner than the residual could at its rate
    lanes = result["lane_s"]
    assert lanes[Lane.ANCHOR] < 0.5 * residual_ideal
    # once the anchor is done the residual runs at its own lane rate
    residual = achieved_gbps(48 * MiB, BURST, CHUNK, lanes[Lane.RESIDUAL] - lanes[Lane.ANCHOR])
    assert abs(residual - 1.0) <= 0.1, (residual, result)


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


def test_receiver_requested_rate_caps_the_sender(link) -> None:
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
    achieved = achieved_gbps(nbytes, BURST, CHUNK, result["data_s"])
    assert abs(achieved - 1.0) <= 0.05, achieved
