"""lynx_decode: KV semantics. The hierarchical anchor/residual codec, KV streams
over lynx_transport, and speculative decoding on a real model."""

from lynx_decode.codec import decode_layer, encode_layer
from lynx_decode.codec_config import Backend, CodecConfig, Scheme, Split, Stream
from lynx_decode.codec_layout import CacheLayout, LayerLayout
from lynx_decode.errors import CodecError, DecodeError

__all__ = [
    "CodecError",
    "DecodeError",
    "CodecConfig",
    "Scheme",
    "Split",
    "Stream",
    "Backend",
    "encode_layer",
    "decode_layer",
    "LayerLayout",
    "CacheLayout",
]
