"""Decode-side exceptions. They live in :mod:`lynx_transport.errors` under the
single root :class:`LynxError`; this module re-exports them for convenience."""

from lynx_transport.errors import (
    BackendError,
    CodecError,
    ConfigError,
    DecodeError,
    LayoutError,
    LynxError,
    ModelError,
    PromptError,
)

__all__ = [
    "LynxError",
    "CodecError",
    "LayoutError",
    "BackendError",
    "DecodeError",
    "ModelError",
    "PromptError",
    "ConfigError",
]
