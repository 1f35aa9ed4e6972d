"""The benchmark layer's exceptions (under :class:`~lynx_transport.errors.LynxError`)."""

from __future__ import annotations

from lynx_transport.errors import LynxError

__all__ = ["LinkError"]


class LinkError(LynxError):
    """Link emulation (network namespaces, tc) could not be set up or torn down."""
