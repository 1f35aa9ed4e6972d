"""The connector's exceptions, a branch of Lynx's one tree (:class:`~lynx_transport.errors.LynxError`)."""

from __future__ import annotations

from lynx_decode.errors import DecodeError

__all__ = ["ConnectorError", "LoadError", "LegError"]


class ConnectorError(DecodeError):
    """The connector cannot do what vLLM asked (bad configuration, an unsupported cache layout)."""


class LoadError(ConnectorError):
    """A request's KV cache could not be loaded (the producer refused, the stream failed or
    timed out, the cache does not fit this model); vLLM's ``kv_load_failure_policy`` decides."""


class LegError(ConnectorError):
    """A leg of the disaggregated proxy (:mod:`lynx_vllm.proxy`) failed: its server answered an
    error, could not be reached, or did not answer within the proxy's timeout.

    ``leg``: ``"prefill"`` or ``"decode"``; ``status``: the HTTP status the client gets (502, 504, or
    the server's own 4xx); ``kind``: the error's ``type`` in the OpenAI-style error body."""

    def __init__(self, leg: str, status: int, kind: str, message: str) -> None:
        super().__init__(f"{leg} leg: {message}")
        self.leg = leg
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, object]:
        """The error as the client sees it: ``{"error": {"message", "type", "code", "leg"}}``."""
        return {"error": {"message": str(self), "type": self.kind, "code": self.status, "leg": self.leg}}
