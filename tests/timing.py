"""Wall-clock checks: the few tests that must measure time, in the manner of trio's
``check_takes_about``.

Such a test is marked ``timing`` (out of the default run; ``make test-timing`` runs
them, and ``.ci/run`` runs that apart) and checks each duration, rate or latency
through the ``timing`` fixture (``tests/conftest.py``)::

    @pytest.mark.timing
    def test_the_anchor_lane_runs_at_the_link_rate(link, timing) -> None:
        ...
        timing.at_most("anchor lane data time", result["lane_data_s"], 1.1 * ideal + chunk_time)

Every check is recorded, ``test: what: measured X (bound Y)``, and the terminal
summary lists them all, passed or failed, so a timing run always shows its numbers.
Every other test asserts what happened (the error, the state left behind), never
how long it took (CONTRIBUTING.md, "Tests").
"""

from __future__ import annotations

import dataclasses

import pytest

__all__ = ["Measurement", "Timing", "RECORDS"]


@dataclasses.dataclass(frozen=True)
class Measurement:
    test: str  # the test's node id
    what: str
    measured: float
    unit: str  # "s", "Gbit/s", "" (a ratio)
    bound: str  # e.g. "<= 0.147 s", "0.95 .. 1.05"
    ok: bool

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        return (f"{verdict:6} {self.test}: {self.what}: measured {_fmt(self.measured, self.unit)} "
                f"(bound {self.bound})")


#: Where the ``timing`` fixture keeps its measurements for the terminal summary.
RECORDS = pytest.StashKey[list[Measurement]]()


def _fmt(value: float, unit: str) -> str:
    return f"{value:.4g}{' ' + unit if unit else ''}"


class Timing:
    """One timing test's checks: each records its measurement, then asserts it."""

    def __init__(self, test: str, records: list[Measurement]) -> None:
        self.test = test
        self._records = records

    def _check(self, what: str, measured: float, unit: str, ok: bool, bound: str) -> None:
        record = Measurement(self.test, what, float(measured), unit, bound, ok)
        self._records.append(record)
        assert ok, f"{what}: measured {_fmt(record.measured, unit)}, bound {bound}"

    def at_most(self, what: str, measured: float, bound: float, unit: str = "s") -> None:
        self._check(what, measured, unit, measured <= bound, f"<= {_fmt(bound, unit)}")

    def less_than(self, what: str, measured: float, bound: float, unit: str = "s") -> None:
        self._check(what, measured, unit, measured < bound, f"< {_fmt(bound, unit)}")

    def at_least(self, what: str, measured: float, bound: float, unit: str = "s") -> None:
        self._check(what, measured, unit, measured >= bound, f">= {_fmt(bound, unit)}")

    def within(self, what: str, measured: float, low: float, high: float, unit: str = "") -> None:
        self._check(what, measured, unit, low <= measured <= high, f"{_fmt(low, unit)} .. {_fmt(high, unit)}")
