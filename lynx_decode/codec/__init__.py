"""The hierarchical KV codec, as a table of planes.

A scheme is a list of *planes*: bit slices of the 8-bit code, each on its own
lane (plane 0, the anchor with the scales, on the highest priority). Modules:
:mod:`~lynx_decode.codec.config` (schemes, the plane table, the frozen
:class:`CodecConfig`), :mod:`~lynx_decode.codec.quant` and
:mod:`~lynx_decode.codec.pack` (the NumPy reference that defines the format),
:mod:`~lynx_decode.codec.layout` (where every region sits, the wire descriptor),
:mod:`~lynx_decode.codec.backends` (NumPy / Numba / CuPy), and
:mod:`~lynx_decode.codec.api` (encode and decode a layer).
"""

from lynx_decode.codec.api import EncodedLayer, decode_layer, encode_layer, int8_codes, lynx_from_int8
from lynx_decode.codec.config import Backend, CodecConfig, Plane, Scheme, Split, parse_planes
from lynx_decode.codec.layout import CacheLayout, LayerLayout

__all__ = ["EncodedLayer", "encode_layer", "decode_layer", "int8_codes", "lynx_from_int8", "CodecConfig", "Scheme",
           "Split", "Backend", "Plane", "parse_planes", "LayerLayout", "CacheLayout"]
