"""The decode layer's exceptions: the codec's and the model's branches of the one
tree rooted at :class:`~lynx_transport.errors.LynxError` (drawn in
:mod:`lynx_transport.errors`). The root-level errors every layer raises
(``BackendError``, ``ConfigError``) are re-exported for convenience."""

from __future__ import annotations

from lynx_transport.errors import BackendError, ConfigError, LynxError

__all__ = [
    "LynxError",
    "CodecError",
    "LayoutError",
    "BackendError",
    "DecodeError",
    "ModelError",
    "PromptError",
    "ServerBusyError",
    "ConfigError",
]


class CodecError(LynxError):
    """Bad input to the KV codec (dtype, shape, contiguity, bits)."""


class LayoutError(CodecError):
    """A layout descriptor is malformed or inconsistent."""


class DecodeError(LynxError):
    """Speculative decoding or the model adapter failed."""


class ModelError(DecodeError):
    """The model could not be found or loaded."""


class PromptError(DecodeError):
    """The prompt is empty or does not fit the model's context window."""


class ServerBusyError(DecodeError):
    """The prefill node is at its admission limit and refused the request; retry later."""
