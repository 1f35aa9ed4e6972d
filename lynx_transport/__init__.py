"""lynx_transport: bytes only. UCX endpoints, a pre-registered receive pool,
priority lanes, bandwidth shaping and completion callbacks.

Knows nothing about KV caches, models or quantization.
"""

from lynx_transport.errors import LynxError, TransportError

__all__ = ["LynxError", "TransportError"]
