"""Scaled dot-product attention that keeps grouped-query K/V grouped.

transformers' ``sdpa`` attention repeats every K/V head for its query heads
(``repeat_kv``: a copy of the whole cache, per layer and per pass) whenever a
pass has more than one query token and hence a mask - exactly Lynx's
verification pass (the last prompt token plus the drafted tokens) and every
prefill chunk after the first. torch's SDPA takes ``enable_gqa=True`` with a
mask on CPU, so this attention passes the grouped heads straight through.

Multi-token passes get faster (one-token passes are unchanged; docs/design.md,
"Measured facts"), and the logits are bit-equal to ``sdpa``'s
(``tests/integration/test_model.py``), so token-for-token results do not move.

Registered (under :data:`NAME`) when a model is loaded, not at import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NAME", "register"]

NAME = "lynx_sdpa_gqa"


def gqa_sdpa_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                       dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature; ``[batch, seq, heads, dim]`` out."""
    import torch  # noqa: PLC0415

    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"{NAME} attention supports neither softcap nor position_bias")
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # like transformers' sdpa: the kernel's own causal mask only without an explicit mask
    causal = bool(q_length > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=causal, enable_gqa=getattr(module, "num_key_value_groups", 1) > 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make :data:`NAME` known to transformers (attention and its mask); idempotent."""
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
