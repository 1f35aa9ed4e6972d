"""The progress bar of the CLI's long runs (``lynx sweep``, ``lynx load``), on stderr."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


class _NoBar:
    """What :func:`progress_bar` gives without tqdm: takes the calls, shows nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, *, disable: bool, unit: str) -> Any:
    """A tqdm bar over ``total`` ``unit``\\ s (``update``, ``set_postfix_str``, ``close``), or one
    that shows nothing when tqdm (the bench extra) is missing."""
    try:
        from tqdm import tqdm  # noqa: PLC0415 - an optional extra (bench)
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit=unit, disable=disable, file=sys.stderr,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")
