"""Model adapters: a causal LM whose KV cache is exported and imported per layer.

Importing this package does not import torch or transformers."""

from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.geometry import LayerGeometry
from lynx_decode.model.hf import HFCausalLM
from lynx_decode.model.identity import ModelFingerprint
from lynx_decode.model.protocol import CausalLM, LMCache, ModelInfo, Prefill
from lynx_decode.model.slab import SlabCache

__all__ = ["CausalLM", "LMCache", "ModelInfo", "Prefill", "KVBuffers", "KVShape", "LayerGeometry",
           "ModelFingerprint", "HFCausalLM", "SlabCache"]
