"""The CLI's progress bar (``lynx_bench.common.progress``): it names the phase, and its time
left comes from timed items only, none before the first (a start-up of a minute is
not an estimate of half an hour)."""

from __future__ import annotations

import pytest

from lynx_bench.common.progress import progress_bar, time_left


def test_time_left_is_the_mean_timed_item_times_the_items_left() -> None:
    assert time_left([], 10) is None
    assert time_left([2.0, 4.0], 5) == pytest.approx(15.0)
    assert time_left([2.0], 0) == 0.0


def _frames(text: str) -> list[str]:
    return [f.strip() for f in text.replace("\r", "\n").split("\n") if f.strip()]


def test_no_estimate_until_a_timed_item_and_the_phase_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress_bar(4, disable=False, unit="run")
    bar.phase("starting the nodes")
    bar.update(timed=False)  # a warm-up
    bar.phase("int8 1 Gbit/s ctx 4096")
    untimed = _frames(capsys.readouterr().err)
    bar.update()
    bar.close()
    timed = _frames(capsys.readouterr().err)
    assert any("starting the nodes" in f for f in untimed)
    assert all("<" not in f for f in untimed), untimed  # [elapsed] only
    assert "2/4" in timed[-1] and "<" in timed[-1] and "int8 1 Gbit/s ctx 4096" in timed[-1], timed


def test_a_disabled_bar_takes_every_call_and_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress_bar(3, disable=True, unit="req")
    bar.phase("warm-up")
    bar.set_postfix_str("x")
    bar.update(timed=False)
    bar.update()
    bar.close()
    assert capsys.readouterr().err == ""
