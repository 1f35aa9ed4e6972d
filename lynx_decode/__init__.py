"""lynx_decode: KV semantics. The hierarchical anchor/residual codec, KV streams
over lynx_transport, and speculative decoding on a real model."""

from lynx_decode.errors import CodecError, DecodeError

__all__ = ["CodecError", "DecodeError"]
