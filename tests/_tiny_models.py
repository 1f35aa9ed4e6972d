"""Tiny, randomly initialised transformers models of several architectures, built
in a test without any download: a byte-level tokenizer made with ``tokenizers``
(256 byte symbols, no merges, an end-of-text token) and a model from its config
class with a fixed seed, saved as a plain transformers directory that
``HFCausalLM.load`` and ``lynx serve --model`` read like any other.

Exactness of Lynx against INT8 greedy decoding does not need trained weights, and
the weights are drawn wide (``initializer_range``) so the logits are far apart and
greedy choices are not near-ties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "WINDOW", "build", "tokenizer"]

#: The sliding window of the sliding-window architectures (positions, the query's own included).
WINDOW = 24

_COMMON: dict[str, Any] = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                               initializer_range=0.2, eos_token_id=256, bos_token_id=None, pad_token_id=None,
                               tie_word_embeddings=False)

#: name -> (config class name, extra config): Llama, Qwen2, Qwen3 with head size 48, Mistral
#: (every layer a sliding window), Gemma3 (sliding layers interleaved with full ones, head size 32).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"head_dim": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3-head48": ("Qwen3Config", {"head_dim": 48}),
    "mistral-sliding": ("MistralConfig", {"head_dim": 16, "sliding_window": WINDOW}),
    "gemma3-interleaved": ("Gemma3TextConfig", {
        "head_dim": 32, "sliding_window": WINDOW, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]}),
}


def tokenizer(*, permuted: bool = False) -> Any:
    """A byte-level tokenizer: every byte one token (ids 0..255), ``<|end|>`` = 256.
    ``permuted`` numbers the bytes in reverse: another tokenizer of the same size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    if permuted:
        symbols = symbols[::-1]
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["<|end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}assistant:"
    return fast


def build(arch: str, directory: Path, *, seed: int = 0, perturb: str | None = None,
          permuted_tokenizer: bool = False, **overrides: Any) -> Path:
    """Save a tiny ``arch`` model (see :data:`ARCHITECTURES`) into ``directory``.

    ``perturb``: the name fragment of one weight (e.g. ``"layers.1.self_attn.k_proj"``)
    nudged by 1e-3 after initialisation: same shapes, other weights.
    ``overrides``: config fields to change (another shape)."""
    import torch
    import transformers

    class_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, class_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if perturb is not None:
        with torch.no_grad():
            hits = [p for name, p in model.named_parameters() if perturb in name]
            assert hits, f"no weight named like {perturb!r}"
            hits[0].add_(1e-3)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer(permuted=permuted_tokenizer).save_pretrained(directory)
    return directory
