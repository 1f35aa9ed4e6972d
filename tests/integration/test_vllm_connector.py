"""LynxConnector inside real vLLM (CPU): producer and consumer instances in processes of their
own, run from the vLLM environment (``make vllm-env``) by :mod:`lynx_bench.vllm.driver`.

A tiny randomly initialised Llama (built here with transformers, no download) and the real
default model. Skipped, with the command that installs it, when the vLLM environment is absent;
``.ci/run`` installs it.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lynx_bench.vllm.driver import VllmNode, free_port
from tests.integration.vllm_env import vllm_python_or_skip
from tests.integration.vllm_models import (
    UNBOUND,
    answer_ok,
    close_all,
    load_records,
    prompt_ids,
    start_instances,
    tiny_llama,
    with_scheme,
)

pytestmark = [pytest.mark.vllm, pytest.mark.ucx]

PYTHON = vllm_python_or_skip()

LAYERS = 8
PROMPT = 2000  # tokens: 16 MB of bf16 KV for the tiny model


class Nodes:
    """The instances of this module, started in parallel."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tiny_llama(tmp / "tiny-llama", layers=LAYERS, kv_heads=4)
        # four instances, two starting at a time
        specs: dict[str, dict[str, Any]] = {
            "producer": dict(role="kv_producer", extra={"port": free_port(), "bandwidth_gbps": 0.2}),
            "doomed": dict(role="kv_producer", extra={"port": free_port(), "bandwidth_gbps": 0.02}),
            "consumer": dict(role="kv_consumer", extra={"stats_path": str(tmp / "consumer.jsonl")}),
            "recompute": dict(role="kv_consumer", policy="recompute",
                              extra={"stats_path": str(tmp / "recompute.jsonl")}),
        }
        self.specs = specs
        self.nodes: dict[str, VllmNode] = start_instances(PYTHON, self.model, tmp, specs, ready_timeout_s=300)

    def __getitem__(self, name: str) -> VllmNode:
        return self.nodes[name]

    def close(self) -> None:
        close_all(self.nodes.values())


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    n = Nodes(tmp_path_factory.mktemp("vllm"))
    yield n
    n.close()


def test_bf16_equals_vllm_and_lynx_equals_int8_with_every_block_loaded_layer_by_layer(nodes: Nodes) -> None:
    ids = prompt_ids(PROMPT)
    reference = answer_ok(nodes["consumer"].generate(ids, 12))["token_ids"]
    assert len(set(reference)) > 2, "the tiny model's greedy output is degenerate; the test would prove little"
    params = answer_ok(nodes["producer"].prefill(ids))["kv_transfer_params"]
    port = nodes.specs["producer"]["extra"]["port"]
    assert params["lynx"] == {"producer": ["127.0.0.1", port], "prompt_tokens": PROMPT}
    out = {s: answer_ok(nodes["consumer"].generate(ids, 12, kv_transfer_params=with_scheme(params, s)))["token_ids"]
           for s in ("bf16", "int8", "lynx", "int4")}
    assert out["bf16"] == reference
    assert out["lynx"] == out["int8"]
    loads = {r["scheme"]: r for r in load_records(nodes.tmp / "consumer.jsonl")}
    assert set(loads) == {"bf16", "int8", "lynx", "int4"}
    for scheme, r in loads.items():
        assert r["error"] is None, r
        assert (r["layers_loaded"], r["tokens_loaded"]) == (LAYERS, PROMPT - 1), r  # every block, no recompute
        assert r["forward_started_at"] < r["last_layer_landed_at"], (scheme, r)    # the forward overlapped
    assert loads["int8"]["bytes_on_wire"] < 0.6 * loads["bf16"]["bytes_on_wire"]
    assert loads["int4"]["bytes_on_wire"] < 0.6 * loads["int8"]["bytes_on_wire"]


@pytest.mark.timing
def test_two_consumers_one_producer_anchors_go_before_an_older_residual(nodes: Nodes) -> None:
    """Timing-dependent by its setup, not its claim: b must ask while a's residual is still on
    the wire, which a loaded machine cannot promise (a's whole transfer takes ~0.3 s). The claim,
    an anchor overtakes an older residual of another peer on one egress, is checked without a
    clock by the transport's tests (test_transport_conformance, test_transport_egress)."""
    ids_a, ids_b = prompt_ids(PROMPT, seed=2), prompt_ids(PROMPT, seed=3)
    producer = nodes["producer"]
    params_a = answer_ok(producer.prefill(ids_a))["kv_transfer_params"]
    params_b = answer_ok(producer.prefill(ids_b))["kv_transfer_params"]
    nodes["consumer"].send({"op": "generate", "id": "a", "prompt_ids": ids_a, "max_tokens": 4,
                            "kv_transfer_params": with_scheme(params_a, "lynx")})
    time.sleep(0.1)  # a's anchors (about 0.17 s at 0.2 Gbit/s) are on the wire
    nodes["recompute"].send({"op": "generate", "id": "b", "prompt_ids": ids_b, "max_tokens": 4,
                             "kv_transfer_params": with_scheme(params_b, "lynx")})
    answer_ok(nodes["consumer"].answer(120))
    answer_ok(nodes["recompute"].answer(120))
    a = next(r for r in load_records(nodes.tmp / "consumer.jsonl") if r["request_id"].startswith("a"))
    b = next(r for r in load_records(nodes.tmp / "recompute.jsonl") if r["request_id"].startswith("b"))
    assert a["error"] is None and b["error"] is None
    assert b["requested_at"] < a["lane1_done_at"], "b must ask while a's residual is still to come"
    assert b["lane0_done_at"] < a["lane1_done_at"], (a, b)  # b's anchors were not queued behind a's residual


#: A generous bound on noticing a killed producer (it takes about a second: the closed
#: connection, not a timeout), below the consumers' 30 s stream timeout it must not wait out.
NOTICED_S = 20.0


def test_a_producer_killed_mid_transfer_fails_or_recomputes_at_once(nodes: Nodes) -> None:
    """Two consumers pull from one producer, which is killed while both streams are on the wire: the
    consumer with kv_load_failure_policy=fail fails its request, the one with recompute prefills the
    prompt itself (the same greedy text), both at once (not after their stream timeout), neither
    keeping anything of the stream."""
    ids = prompt_ids(PROMPT, seed=4)
    failing, recomputing = nodes["consumer"], nodes["recompute"]
    reference = answer_ok(recomputing.generate(ids, 6))["token_ids"]
    params = with_scheme(answer_ok(nodes["doomed"].prefill(ids))["kv_transfer_params"], "bf16")
    for consumer in (failing, recomputing):  # 16 MB each at 0.02 Gbit/s shared: ~13 s
        consumer.send({"op": "generate", "id": "k", "prompt_ids": ids, "max_tokens": 6,
                       "kv_transfer_params": params})
    time.sleep(1.5)
    nodes["doomed"].kill()
    killed = time.monotonic()
    failed, recomputed = failing.answer(60), recomputing.answer(60)
    took = time.monotonic() - killed
    assert took < NOTICED_S, (took, failed, recomputed)
    assert failed.get("error") is not None or failed["finish_reason"] == "error", failed
    assert recomputed.get("error") is None and recomputed["token_ids"] == reference, recomputed
    for stats in ("consumer.jsonl", "recompute.jsonl"):
        record = [r for r in load_records(nodes.tmp / stats) if r["request_id"].startswith("k")][-1]
        assert record["error"] is not None and record["layers_loaded"] < LAYERS, record  # nothing partial kept
    # the producer is gone now: a new request for its cache fails (or recomputes) at once
    started = time.monotonic()
    failed = failing.generate(ids, 6, kv_transfer_params=params)
    recomputed = recomputing.generate(ids, 6, kv_transfer_params=params)
    assert time.monotonic() - started < NOTICED_S  # a generous bound: its port is closed, both answer at once
    assert failed.get("error") is not None or failed["finish_reason"] == "error", failed
    assert recomputed.get("error") is None and recomputed["token_ids"] == reference, recomputed


def test_the_default_model_bf16_equals_vllm_and_lynx_equals_int8(tmp_path: Path) -> None:
    from lynx_decode.model.store import converted_model_dir, default_gguf_path

    model = converted_model_dir(default_gguf_path())
    ids = _ok_prompt(model)
    with cf.ThreadPoolExecutor(2) as pool:
        pf = pool.submit(VllmNode, PYTHON, model, role="kv_producer", log=tmp_path / "producer.log",
                         extra={"port": free_port(), "bandwidth_gbps": 1.0}, env=UNBOUND)
        cf_ = pool.submit(VllmNode, PYTHON, model, role="kv_consumer", log=tmp_path / "consumer.log",
                          extra={"stats_path": str(tmp_path / "loads.jsonl")}, env=UNBOUND)
        producer, consumer = pf.result(), cf_.result()
    try:
        reference = answer_ok(consumer.generate(ids, 8))["token_ids"]
        params = answer_ok(producer.prefill(ids))["kv_transfer_params"]
        out = {s: answer_ok(consumer.generate(ids, 8, kv_transfer_params=with_scheme(params, s)))["token_ids"]
               for s in ("bf16", "int8", "lynx")}
    finally:
        close_all((producer, consumer))
    assert out["bf16"] == reference
    assert out["lynx"] == out["int8"]
    loads = load_records(tmp_path / "loads.jsonl")
    assert [r["scheme"] for r in loads] == ["bf16", "int8", "lynx"]
    assert all(r["error"] is None and r["layers_loaded"] == 30 and r["tokens_loaded"] == len(ids) - 1
               for r in loads), loads


def _ok_prompt(model: Path) -> list[int]:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    text = ("The decode node starts generating as soon as the anchors land, and verifies the drafted "
            "tokens once the residual arrives. ") * 30
    return list(tok.encode(text).ids)[:600]
