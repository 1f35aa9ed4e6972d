"""The root of Lynx's exception tree, and the transport's branch of it.

Every error Lynx raises derives from :class:`LynxError`. The transport is the
bottom layer, so the root lives here; each layer defines its own branch in its
own ``errors`` module and everything above may import it::

    LynxError                           lynx_transport.errors
    ├── TransportError                  lynx_transport: moving bytes
    │   ├── ConnectError                nobody listening, handshake refused
    │   │   └── AuthenticationError     wrong or missing shared secret
    │   ├── PeerDisconnectedError       the peer died, closed, or went silent
    │   ├── TransportTimeoutError       a blocking call ran past its timeout
    │   ├── ProtocolError               a bad frame from the wire
    │   │   └── ManifestError           a manifest that is malformed or too big
    │   ├── PoolExhaustedError          the receive pool cannot hold a stream
    │   ├── ClosedError                 the object was closed by its owner
    │   ├── StreamFailedError           a stream ended failed (carries the reason)
    │   └── StreamCancelledError        a stream ended cancelled (by its sender)
    ├── BackendError                    a requested backend (CuPy, Numba) is unavailable
    ├── ConfigError                     bad user arguments (CLI, configs), any layer
    ├── CodecError                      lynx_decode.errors: format and layout
    │   └── LayoutError                 a layout descriptor is inconsistent
    ├── DecodeError                     lynx_decode.errors: model and generation
    │   ├── ModelError                  the model cannot be found or loaded
    │   └── PromptError                 the prompt does not fit the model
    └── LinkError                       lynx_bench.common.errors: tc / namespace emulation

``BackendError`` and ``ConfigError`` sit at the root because every layer raises
them (the receive pool asks for CuPy as the codec does). Backend exceptions
(ucxx, OSError, ...) are translated into this tree in exactly one place per
backend (``raise Mapped(...) from exc``).
"""

from __future__ import annotations

__all__ = [
    "LynxError",
    "TransportError",
    "ConnectError",
    "AuthenticationError",
    "PeerDisconnectedError",
    "TransportTimeoutError",
    "ProtocolError",
    "ManifestError",
    "PoolExhaustedError",
    "ClosedError",
    "StreamFailedError",
    "StreamCancelledError",
    "BackendError",
    "ConfigError",
]


class LynxError(Exception):
    """Root of every exception Lynx raises."""


class TransportError(LynxError):
    """Something went wrong moving bytes."""


class ConnectError(TransportError):
    """A connection could not be established (nobody listening, refused)."""


class AuthenticationError(ConnectError):
    """The peer failed the shared-secret handshake."""


class PeerDisconnectedError(TransportError):
    """The peer closed the connection, died, or stopped answering heartbeats."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A blocking call did not finish within its timeout."""


class ProtocolError(TransportError):
    """A frame from the wire is malformed (magic, version, sizes, offsets)."""


class ManifestError(ProtocolError):
    """A stream manifest is malformed, inconsistent or larger than allowed."""


class PoolExhaustedError(TransportError):
    """The receive pool has no room for the stream's regions."""


class ClosedError(TransportError):
    """The object was closed by its owner and cannot be used any more."""


class StreamFailedError(TransportError):
    """A stream ended in the failed state; ``reason`` says why."""

    def __init__(self, message: str, reason: BaseException | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class StreamCancelledError(TransportError):
    """A stream ended in the cancelled state (its sender abandoned it)."""


class BackendError(LynxError):
    """A requested compute backend (numba, cupy) is unavailable."""


class ConfigError(LynxError, ValueError):
    """A user argument or configuration value is invalid."""
