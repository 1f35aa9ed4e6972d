"""The connector's exceptions, a branch of Lynx's one tree (:class:`~lynx_transport.errors.LynxError`)."""

from __future__ import annotations

from lynx_decode.errors import DecodeError

__all__ = ["ConnectorError", "LoadError"]


class ConnectorError(DecodeError):
    """The connector cannot do what vLLM asked (bad configuration, an unsupported cache layout)."""


class LoadError(ConnectorError):
    """A request's KV cache could not be loaded (the producer refused, the stream failed or
    timed out, the cache does not fit this model); vLLM's ``kv_load_failure_policy`` decides."""
