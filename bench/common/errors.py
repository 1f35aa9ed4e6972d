"""The benchmark layer's exceptions (under :class:`~lynx_transport.errors.LynxError`)."""

from __future__ import annotations

from lynx_transport.errors import LynxError

__all__ = ["LinkError", "VllmNodeError"]


class LinkError(LynxError):
    """Link emulation (network namespaces, tc) could not be set up or torn down."""


class VllmNodeError(LynxError):
    """A vLLM instance driven by :mod:`lynx_bench.vllm.driver` failed to start, died or did not answer."""
