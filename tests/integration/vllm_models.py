"""What the vLLM tests share: a tiny randomly initialised Llama built with transformers (no
download), reproducible prompt token ids, a hand-off's ``kv_transfer_params`` with another
Lynx scheme, the consumer's load records, and an answer that must carry no error."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["UNBOUND", "answer_ok", "close_all", "load_records", "prompt_ids", "start_instances",
           "tiny_llama", "with_scheme"]


def tiny_llama(directory: Path, *, layers: int, kv_heads: int) -> Path:
    """A bf16 Llama of ``layers`` layers and ``kv_heads`` KV heads of 64 (a 512-token
    vocabulary, 4096 positions), seeded, saved in ``directory``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=kv_heads,
                                      num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=4096,
                                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    """``n`` token ids in [2, 511), the same for the same seed."""
    return [(i * 7919 + seed * 104729) % 509 + 2 for i in range(n)]


def with_scheme(params: dict[str, Any], scheme: str) -> dict[str, Any]:
    """A copy of a producer's ``kv_transfer_params`` asking for ``scheme``; ``lynx`` with the fixed
    split 4,4, so the LYNX planes cross (the connector's default, ``auto``, pulls INT8 in vLLM;
    ``test_vllm_serve`` runs that default)."""
    p = json.loads(json.dumps(params))
    p["lynx"]["scheme"] = scheme
    if scheme == "lynx":
        p["lynx"]["planes"] = [4, 4]
    return p


def load_records(path: Path) -> list[dict[str, Any]]:
    """The consumer's load records (``stats_path``, JSON lines), none if not written yet."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def answer_ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer.get("error") is None, answer
    return answer


#: What every test instance runs with: vLLM's CPU worker binds itself to CPU 0 when it has one
#: thread (``lynx_bench.vllm.nodes``), so every instance of a test would share one core while
#: the other idles; unbound, as the OpenAI servers of ``vllm_servers`` run.
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def start_instances(python: str, model: Path, logs: Path, specs: dict[str, dict[str, Any]], *,
                    ready_timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One :class:`~lynx_bench.vllm.driver.VllmNode` per spec (its keyword arguments), two
    starting at a time (more at once do not start in time on two cores), logs in ``logs``,
    :data:`UNBOUND` unless ``env`` says otherwise; every one that started is closed again
    when any fails (AssertionError naming each)."""
    import concurrent.futures as cf

    from lynx_bench.vllm.driver import VllmNode

    nodes: dict[str, Any] = {}
    errors = []
    with cf.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(VllmNode, python, model, log=logs / f"{name}.log",
                                     ready_timeout_s=ready_timeout_s, env={**UNBOUND, **(env or {})}, **spec)
                   for name, spec in specs.items()}
        for name, future in futures.items():
            try:
                nodes[name] = future.result()
            except Exception as exc:
                errors.append(f"{name}: {exc}")
    if errors:
        close_all(nodes.values())
        raise AssertionError("vLLM instances failed to start:\n" + "\n".join(errors))
    return nodes


def close_all(nodes: Iterable[Any]) -> None:
    """Close vLLM instances at once, not one after another: a graceful engine shutdown takes
    several seconds of waiting, little of it on a CPU."""
    import concurrent.futures as cf

    nodes = list(nodes)
    if nodes:
        with cf.ThreadPoolExecutor(len(nodes)) as pool:
            for future in [pool.submit(node.close) for node in nodes]:
                future.result()
