"""Acceptance of anchor-only drafts vs draft length, and the codec split choice.

Run as a measurement (prints JSON; minutes on a 2-core CPU)::

    .venv/bin/python -m tests.integration.test_speculative_acceptance [n_prompts [first]]

For each prompt (pass-key and filler prose of ~2k tokens, seeds 301+, only ever
used here), anchor width b in {2, 3, 4} and codec split (MSB/centre vs
QuantSpec-style ROUNDED):

- ``lead``: leading tokens where greedy decoding on the anchor-only cache equals
  greedy decoding on the INT8 cache (32 new tokens);
- ``accepted[k]``: drafts accepted when the first k anchor-only drafts are
  verified in one pass on the INT8 cache (one-shot, as the engine does when the
  residual lands after k drafts), for k in 2, 4, 8, 16, 32.

The ``slow`` test checks on one prompt that the one-pass verification accepts
exactly ``min(k, lead)`` drafts, i.e. agrees with sequential decoding.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from lynx_decode.model import HFCausalLM, KVBuffers

from .test_model import load_model

pytestmark = pytest.mark.model

KS = (2, 4, 8, 16, 32)
NEW = 32
PROMPTS = [("passkey", 0.5, 301), ("prose", None, 302), ("passkey", 0.9, 303),
           ("prose", None, 304), ("passkey", 0.25, 305)]


def _prompt(model: HFCausalLM, kind: str, depth: float | None, seed: int) -> list[int]:
    from lynx_bench.accuracy.workload import filler_prose, passkey_prompt

    if kind == "passkey":
        return model.tokenize(passkey_prompt(model.tokenize, 2100, depth, seed).prompt)
    return model.tokenize(filler_prose(model.tokenize, 2100, seed))


def _caches(kv: KVBuffers, bits: int, split: object) -> tuple[KVBuffers, KVBuffers]:
    from lynx_decode.codec import decode_layer, encode_layer
    from lynx_decode.codec.config import CodecConfig, Scheme

    draft, int8 = KVBuffers(kv.shape, headroom=NEW + 8), KVBuffers(kv.shape, headroom=NEW + 8)
    for i in range(kv.shape.num_layers):
        k, v = np.ascontiguousarray(kv.keys[i]), np.ascontiguousarray(kv.values[i])
        enc = encode_layer(k, v, CodecConfig(Scheme.LYNX, bits=bits, split=split))
        draft.write_layer(i, *decode_layer(enc.layout, enc.buffers[0]))
        plain = encode_layer(k, v, CodecConfig(Scheme.INT8, bits=bits, split=split))
        int8.write_layer(i, *decode_layer(plain.layout, plain.buffers[0]))
    return draft, int8


def _greedy(model: HFCausalLM, ids: list[int], kv: KVBuffers) -> list[int]:
    cache = model.cache_from(kv)
    out, x = [], ids[-1]
    for _ in range(NEW):
        x = int(np.argmax(model.forward(cache, [x])[-1]))
        out.append(x)
    return out


def _accepted(model: HFCausalLM, ids: list[int], kv: KVBuffers, drafts: list[int]) -> int:
    preds = np.argmax(model.forward(model.cache_from(kv), [ids[-1], *drafts]), axis=-1)
    n = 0
    while n < len(drafts) and drafts[n] == int(preds[n]):
        n += 1
    return n


def measure_prompt(model: HFCausalLM, ids: list[int], bits_list=(2, 3, 4),
                   splits=None) -> list[dict]:
    from lynx_decode.codec.config import Split

    prefill = model.prefill(ids)
    rows = []
    for split in splits or list(Split):
        for bits in bits_list:
            draft, int8 = _caches(prefill.kv, bits, split)
            anchor_out, int8_out = _greedy(model, ids, draft), _greedy(model, ids, int8)
            lead = next((i for i, (a, b) in enumerate(zip(anchor_out, int8_out)) if a != b), NEW)
            accepted = {k: _accepted(model, ids, int8, anchor_out[:k]) for k in KS}
            rows.append({"split": split.value, "bits": bits, "tokens": len(ids), "lead": lead,
                         "accepted": accepted})
    return rows


@pytest.mark.slow
def test_one_pass_verify_accepts_exactly_the_sequential_agreement() -> None:
    model = load_model()
    ids = _prompt(model, *PROMPTS[0])
    for row in measure_prompt(model, ids, bits_list=(2, 4)):
        assert row["accepted"] == {k: min(k, row["lead"]) for k in KS}, row


def main(n_prompts: int, first: int = 0) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = load_model()
    rows = []
    for case in PROMPTS[first:first + n_prompts]:
        for row in measure_prompt(model, _prompt(model, *case)):
            rows.append({"prompt": f"{case[0]}-{case[2]}", **row})
            sys.stdout.write(json.dumps(rows[-1]) + "\n")
            sys.stdout.flush()
    summary = {}
    for split in sorted({r["split"] for r in rows}):
        for bits in sorted({r["bits"] for r in rows}):
            sel = [r for r in rows if r["split"] == split and r["bits"] == bits]
            summary[f"{split}-b{bits}"] = {
                "mean_lead": sum(r["lead"] for r in sel) / len(sel),
                "acceptance": {k: sum(r["accepted"][k] for r in sel) / (k * len(sel))
                               for k in KS}}
    sys.stdout.write(json.dumps({"summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3])) if len(sys.argv) > 1 else main(3)
