"""When a stream's missing bytes are due (:func:`arrival_eta`): the rule the decode engine
uses to decide whether a layer waits for its exact K/V or reads its anchors."""

from __future__ import annotations

import pytest

from lynx_decode.kvassembler import OWN_RATE_AFTER, arrival_eta

TOTAL = 4_000_000


def test_nothing_missing_is_due_now() -> None:
    assert arrival_eta(0, 0, TOTAL, None, 5.0, None) == 0.0
    assert arrival_eta(0, TOTAL, TOTAL, 1.0, 5.0, 1.0) == 0.0


def test_with_neither_a_prior_nor_two_regions_nothing_is_known() -> None:
    assert arrival_eta(TOTAL, 0, TOTAL, None, 5.0, None) is None


def test_the_prior_rate_rules_until_a_share_of_the_stream_has_landed() -> None:
    # two regions in, 2 ms apart, as a stream's first ones come on loopback: the stream's own
    # rate (30 MB/s) would put the rest 130 ms away; the connection's last stream flowed at
    # 2 Gbit/s, which puts it 16 ms away
    landed, missing = 60_000, TOTAL - 120_000
    assert arrival_eta(missing, landed, TOTAL, 1.000, 1.002, 2.0) == pytest.approx(missing * 8 / 2e9)
    assert arrival_eta(missing, landed, TOTAL, 1.000, 1.002, None) == pytest.approx(missing * 0.002 / landed)


def test_the_streams_own_rate_rules_once_enough_has_landed() -> None:
    landed = int(OWN_RATE_AFTER * TOTAL)
    missing = TOTAL - landed - 60_000
    own = missing * 0.010 / landed
    assert arrival_eta(missing, landed, TOTAL, 1.000, 1.010, 2.0) == pytest.approx(own)
    assert arrival_eta(missing, landed - 1, TOTAL, 1.000, 1.010, 2.0) == pytest.approx(missing * 8 / 2e9)


def test_before_the_second_region_the_prior_alone_answers() -> None:
    assert arrival_eta(TOTAL, 0, TOTAL, None, 1.0, 8.0) == pytest.approx(TOTAL * 8 / 8e9)
