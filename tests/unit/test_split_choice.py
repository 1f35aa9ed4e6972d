"""``--anchor-bits auto``: the split rule (pure), and a decode node that applies it."""

from __future__ import annotations

import math

import pytest

from lynx_decode.errors import CodecError
from lynx_decode.split_choice import NO_SPLIT_STEPS, THREE_BIT_STEPS, choose_split

MB = 1_000_000


@pytest.mark.parametrize(("int8_mb", "gbps", "step_s", "planes"), [
    (12.5, 10.0, 0.07, None),     # 10 Gbit/s, 1k tokens: 10 ms on the link, a step is 70 ms
    (47.0, 1.0, 0.096, (4, 4)),   # the headline: 1 Gbit/s, 4k tokens, ~4 steps
    (47.0, 0.5, 0.096, (4, 4)),   # half the rate: 7.8 steps
    (47.0, 0.4, 0.096, (3, 5)),   # 9.8 steps
    (47.0, 0.1, 0.096, (3, 5)),
])
def test_the_rule(int8_mb: float, gbps: float, step_s: float, planes: tuple[int, ...] | None) -> None:
    choice = choose_split(int(int8_mb * MB), gbps, step_s)
    assert choice.planes == planes
    assert math.isclose(choice.transfer_s, int8_mb * MB * 8 / (gbps * 1e9))
    assert ("no split" in choice.reason) is (planes is None)


def test_the_thresholds_are_in_decode_steps() -> None:
    step = 0.1
    rate = 1.0  # Gbit/s: 1 ms per 125 kB
    just_below = int((NO_SPLIT_STEPS * step - 1e-4) * rate * 1e9 / 8)
    assert choose_split(just_below, rate, step).planes is None
    assert choose_split(int(NO_SPLIT_STEPS * step * rate * 1e9 / 8) + 8, rate, step).planes == (4, 4)
    assert choose_split(int(THREE_BIT_STEPS * step * rate * 1e9 / 8) + 8, rate, step).planes == (3, 5)


@pytest.mark.parametrize(("args", "needle"), [((0, 1.0, 0.1), "int8_bytes"), ((10, 0.0, 0.1), "rate"),
                                              ((10, float("inf"), 0.1), "rate"), ((10, 1.0, 0.0), "step_s")])
def test_bad_input(args: tuple[int, float, float], needle: str) -> None:
    with pytest.raises(CodecError, match=needle):
        choose_split(*args)
