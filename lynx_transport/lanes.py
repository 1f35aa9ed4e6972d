"""Lanes: the priority classes a region travels on.

A lane is a small integer; a lower number is a higher priority. ``Lane`` names
the two lanes Lynx uses (anchor first, residual after), but the scheduler, the
shaper and the wire format accept any lane in ``range(MAX_LANES)`` so a layer
above can add more classes without changing the transport.
"""

from __future__ import annotations

import enum

__all__ = ["Lane", "MAX_LANES", "check_lane"]

#: Lanes ``0 .. MAX_LANES - 1`` are valid on the wire; anything else is rejected.
MAX_LANES = 8


class Lane(enum.IntEnum):
    """Named lanes. Priority is by number: ``ANCHOR`` (0) always goes before ``RESIDUAL`` (1)."""

    ANCHOR = 0
    RESIDUAL = 1


def check_lane(lane: int) -> int:
    """Return ``lane`` as a plain int, or raise ``ValueError`` if it is out of range."""
    if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < MAX_LANES:
        raise ValueError(f"lane must be an int in [0, {MAX_LANES}), got {lane!r}")
    return int(lane)
