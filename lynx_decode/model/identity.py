"""Model identity: a fingerprint of everything that makes a KV cache valid for a model.

A cache computed by one model is garbage to another, even of the same shape, and
nothing downstream can tell (an INT8 rerun reuses the same foreign cache). So
the KV stream header carries the prefill node's :class:`ModelFingerprint` and
the decode node refuses a stream whose fingerprint differs from its own, naming
both models and what differs, before any decoding.

Three parts, each a SHA-256 (hex, 32 digits kept):

- ``weights``: every tensor of the model's ``state_dict`` in name order (name,
  dtype, shape, bytes): a perturbed projection changes it;
- ``config``: the config keys that shape K/V (:data:`CONFIG_KEYS`: sizes,
  attention, RoPE, windows, norms) and Lynx's per-layer geometry; names, paths,
  versions and generation settings are left out;
- ``tokenizer``: the tokenizer's full definition (a fast tokenizer's JSON, else
  its vocabulary and special tokens): the prompt's ids are the prefill node's
  and the text is the decode node's, so both must read ids alike.

Hashing the weights reads every byte of them, so a
fingerprint is computed once per model directory and cached on disk (JSON under
``<cache root>/fingerprints/``, keyed by the directory's id, which changes when
any of its files does; see ``store.directory_model_id``) and in memory on the
loaded model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lynx_decode.errors import LayoutError
from lynx_decode.model.geometry import LayerGeometry, geometry_json

__all__ = ["ModelFingerprint", "CONFIG_KEYS", "fingerprint_model", "cached_fingerprint"]

DIGITS = 32
FINGERPRINT_VERSION = 1

#: Config keys that change what a model's K/V caches hold (those present are hashed).
CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation",
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq", "partial_rotary_factor",
    "attention_bias", "mlp_bias", "qk_norm", "use_qk_norm", "query_pre_attn_scalar",
    "attn_logit_softcapping", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "attention_chunk_size", "tie_word_embeddings", "embedding_multiplier",
    "attention_multiplier", "residual_multiplier", "logits_scaling",
)


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """What a KV cache was computed with: ``name`` (for messages only) and the
    ``weights``, ``config`` and ``tokenizer`` digests."""

    name: str
    weights: str
    config: str
    tokenizer: str

    PARTS = ("weights", "config", "tokenizer")

    def differences(self, other: ModelFingerprint) -> list[str]:
        """The parts (``weights``, ``config``, ``tokenizer``) in which the two differ."""
        return [p for p in self.PARTS if getattr(self, p) != getattr(other, p)]

    def short(self) -> str:
        """``name`` with the first digits of each part, for messages."""
        return f"{self.name} (weights {self.weights[:12]}, config {self.config[:12]}, " \
               f"tokenizer {self.tokenizer[:12]})"

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> ModelFingerprint:
        """Parse a fingerprint; :class:`LayoutError` when malformed."""
        if not isinstance(obj, dict) or set(obj) != {"name", *cls.PARTS}:
            raise LayoutError("a model fingerprint needs name, weights, config and tokenizer")
        if not all(isinstance(v, str) and len(v) <= 512 for v in obj.values()):
            raise LayoutError("a model fingerprint's fields must be short strings")
        for part in cls.PARTS:
            value = obj[part]
            if len(value) != DIGITS or any(c not in "0123456789abcdef" for c in value):
                raise LayoutError(f"a model fingerprint's {part} must be {DIGITS} hex digits")
        return cls(obj["name"], obj["weights"], obj["config"], obj["tokenizer"])


def _weights_digest(model: Any) -> str:
    import torch  # noqa: PLC0415 - only with a torch model in hand

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(memoryview(t.numpy()).cast("B"))
    return h.hexdigest()[:DIGITS]


def _config_digest(config: Any, layers: Sequence[LayerGeometry]) -> str:
    full = config.to_dict()
    picked = {k: full[k] for k in CONFIG_KEYS if k in full}
    text = json.dumps({"config": picked, "geometry": geometry_json(layers)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGITS]


def _tokenizer_digest(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("truncation", None)  # call-time settings, not the tokenizer
        definition.pop("padding", None)
    else:
        definition = {"vocab": sorted(tokenizer.get_vocab().items())}
    definition = {"tokenizer": definition, "special": sorted(map(str, tokenizer.all_special_tokens))}
    text = json.dumps(definition, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGITS]


def fingerprint_model(name: str, model: Any, tokenizer: Any, layers: Sequence[LayerGeometry]) -> ModelFingerprint:
    """Compute the fingerprint of a loaded transformers model (reads every weight)."""
    config = model.config.get_text_config(decoder=True)
    return ModelFingerprint(name, _weights_digest(model), _config_digest(config, layers),
                            _tokenizer_digest(tokenizer))


def cached_fingerprint(key: str, root: Path, name: str, model: Any, tokenizer: Any,
                       layers: Sequence[LayerGeometry]) -> ModelFingerprint:
    """The fingerprint stored under ``key`` in ``root``, else computed and stored
    (a cache that cannot be written is skipped: the fingerprint is computed again)."""
    path = root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("version") == FINGERPRINT_VERSION and stored.get("key") == key:
            return dataclasses.replace(ModelFingerprint.from_json(stored["fingerprint"]), name=name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, LayoutError):
        pass
    fingerprint = fingerprint_model(name, model, tokenizer, layers)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=root)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": FINGERPRINT_VERSION, "key": key, "fingerprint": fingerprint.to_json()}, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return fingerprint
