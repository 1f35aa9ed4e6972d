"""lynx_decode: KV semantics. The hierarchical codec (a table of bit planes), KV streams
over lynx_transport, and speculative decoding on a real model.

Importing it does not import torch, transformers or ucxx (they load on first use).
"""

from lynx_decode.codec import Backend, CacheLayout, CodecConfig, LayerLayout, Scheme, Split, decode_layer, encode_layer
from lynx_decode.decode_config import DecodeConfig
from lynx_decode.decode_node import DecodeNode, RunResult
from lynx_decode.errors import CodecError, DecodeError
from lynx_decode.events import Committed, Done, Rollback, Tentative
from lynx_decode.model import CausalLM, HFCausalLM, KVBuffers
from lynx_decode.prefill_cache import PrefillCache
from lynx_decode.prefill_node import PrefillNode
from lynx_decode.speculative import decode_events, generate
from lynx_decode.timeouts import Timeouts

__all__ = [
    "CodecError",
    "DecodeError",
    "CodecConfig",
    "Scheme",
    "Split",
    "Backend",
    "encode_layer",
    "decode_layer",
    "LayerLayout",
    "CacheLayout",
    "CausalLM",
    "HFCausalLM",
    "KVBuffers",
    "PrefillCache",
    "DecodeConfig",
    "generate",
    "decode_events",
    "Tentative",
    "Committed",
    "Rollback",
    "Done",
    "PrefillNode",
    "DecodeNode",
    "RunResult",
    "Timeouts",
]
