"""The progress bar of the CLI's long runs (``lynx sweep``, ``lynx load``, ``lynx accuracy``), on stderr.

The bar names what runs now (:meth:`phase`: nodes starting, a warm-up, the run
being measured), and its time left comes only from timed items: each item's time
runs from the last :meth:`phase` or :meth:`update` to its :meth:`update`, and an
item updated with ``timed=False`` (a warm-up, a first prefill) does not count. So
a start-up of a minute shows as ``[01:00] starting the nodes`` with no estimate,
never as an estimate of half an hour drawn from it; after the first timed item the
bar shows ``[elapsed<left]``, the mean timed item times the items left.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import MutableMapping
from typing import Any, Protocol

__all__ = ["Progress", "progress_bar"]

BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{left}] {phase}"


class Progress(Protocol):
    """What :func:`progress_bar` returns."""

    def phase(self, text: str) -> None:
        """Show ``text`` as what runs now; the next item's time starts here."""

    def set_postfix_str(self, text: str) -> None:
        """The same as :meth:`phase`."""

    def update(self, n: int = 1, *, timed: bool = True) -> None:
        """``n`` items done; ``timed=False``: their time says nothing of the items left."""

    def close(self) -> None:
        """Stop drawing."""


class _NoBar:
    """What :func:`progress_bar` gives without tqdm or when disabled: takes the calls, shows nothing."""

    def phase(self, text: str) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def update(self, n: int = 1, *, timed: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def time_left(item_s: list[float], left: int) -> float | None:
    """Seconds left for ``left`` more items at the mean of the timed ones, ``None`` before any."""
    return statistics.fmean(item_s) * left if item_s else None


def progress_bar(total: int, *, disable: bool, unit: str) -> Progress:
    """A tqdm bar over ``total`` ``unit``\\ s with named phases and an estimate from timed
    items only, or one that shows nothing when disabled or tqdm (the bench extra) is missing."""
    if disable:
        return _NoBar()
    try:
        from tqdm import tqdm  # noqa: PLC0415 - an optional extra (bench)
    except ImportError:
        return _NoBar()

    class _Bar(tqdm):
        def __init__(self) -> None:
            self._item_s: list[float] = []
            self._mark = time.monotonic()
            self._phase = ""
            super().__init__(total=total, unit=unit, file=sys.stderr, bar_format=BAR_FORMAT)

        def phase(self, text: str) -> None:
            self._mark = time.monotonic()
            self._phase = text
            self.refresh()

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            self.phase(s)

        def update(self, n: float | None = 1, *, timed: bool = True) -> None:
            now = time.monotonic()
            if timed and n:
                self._item_s.extend([(now - self._mark) / n] * int(n))
            self._mark = now
            super().update(n)

        @property
        def format_dict(self) -> MutableMapping[str, Any]:
            d = super().format_dict
            left = time_left(getattr(self, "_item_s", []), max(0, int(self.total or 0) - int(self.n)))
            d["left"] = "" if left is None else f"<{tqdm.format_interval(left)}"
            d["phase"] = getattr(self, "_phase", "")
            return d

    return _Bar()
