"""LynxConnector inside real vLLM (CPU), loading synchronously (the default) and asynchronously
(``load: "async"``): producer and consumer instances in processes of their own, run from the vLLM
environment (``make vllm-env``) by :mod:`lynx_bench.vllm.driver`.

The instances of the tiny model, shared by this module's tests and started two at a time: a
producer held to 0.2 Gbit/s by Lynx's own shaper, a ``doomed`` producer at 0.02 Gbit/s (a test
kills it mid-transfer), a ``consumer`` that loads synchronously with ``kv_load_failure_policy``
``fail``, and an ``async`` consumer that loads asynchronously with ``recompute``. So a killed
producer's load fails in one mode and is recomputed in the other.

The asynchronous claim: a long transfer that lands while another request is decoding stalls
that request in sync mode (the forward that waits inside its layers for the new request's cache
is the running request's forward too) and does not in async mode (a Lynx thread writes the
layers while the engine keeps stepping). Asserted as a cause: the running request's largest gap
between tokens against the transfer time from the same load's record (``stats_path``), both on
this host's wall clock; never against a fixed duration. And the output of an asynchronous load
is a synchronous load's, token for token (greedy).

A tiny randomly initialised Llama with a wide cache (8 layers, 8 KV heads of 64), built here with
transformers (no download), and the real default model. Skipped, with the command that installs
it, when the vLLM environment is absent; ``.ci/run`` installs it.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
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
LINK_GBPS = 0.2
PROMPT = 2000  # tokens: 33 MB of bf16 KV for the tiny model, 1.3 s at 0.2 Gbit/s
#: The asynchronously loaded prompt: 4000 tokens x 8 layers x 8 KV heads x 64 x 2 (K, V) x 2
#: bytes = 65 MB of bf16 cache, about 2.6 s at 0.2 Gbit/s; a running request decodes meanwhile.
LONG = 4000
RUNNING_PROMPT = 32
RUNNING_TOKENS = 3500  # more than it can decode while the load lands; aborted soon after the load ends
LOAD_TOKENS = 6
#: Each load mode's consumer.
MODES = {"sync": "consumer", "async": "async"}


class Nodes:
    """The instances of this module, started in parallel (two at a time)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tiny_llama(tmp / "tiny-llama-wide", layers=LAYERS, kv_heads=8)
        self.specs: dict[str, dict[str, Any]] = {
            "producer": dict(role="kv_producer", extra={"port": free_port(), "bandwidth_gbps": LINK_GBPS}),
            "doomed": dict(role="kv_producer", extra={"port": free_port(), "bandwidth_gbps": 0.02}),
            "consumer": dict(role="kv_consumer", extra={"stats_path": str(tmp / "consumer.jsonl")}),
            "async": dict(role="kv_consumer", policy="recompute",
                          extra={"stats_path": str(tmp / "async.jsonl"), "load": "async"}),
        }
        # unbound (start_instances' default): vLLM's CPU worker would bind itself, and so every
        # Lynx thread it starts, to CPU 0, where an async load's receiver would share one core
        # with the worker's spinning step loop
        self.nodes: dict[str, VllmNode] = start_instances(PYTHON, self.model, tmp, self.specs, ready_timeout_s=600)

    def __getitem__(self, name: str) -> VllmNode:
        return self.nodes[name]

    def records(self, name: str) -> list[dict[str, Any]]:
        """The load records of consumer ``name`` so far."""
        return load_records(self.tmp / f"{name}.jsonl")

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
    before = len(nodes.records("consumer"))  # the other tests' loads (in any order) are not this one's
    out = {s: answer_ok(nodes["consumer"].generate(ids, 12, kv_transfer_params=with_scheme(params, s)))["token_ids"]
           for s in ("bf16", "int8", "lynx", "int4")}
    assert out["bf16"] == reference
    assert out["lynx"] == out["int8"]
    loads = {r["scheme"]: r for r in nodes.records("consumer")[before:]}
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
    the wire, which a loaded machine cannot promise (a's whole transfer takes ~0.7 s). The claim,
    an anchor overtakes an older residual of another peer on one egress, is checked without a
    clock by the transport's tests (test_transport_conformance, test_transport_egress)."""
    ids_a, ids_b = prompt_ids(PROMPT, seed=2), prompt_ids(PROMPT, seed=3)
    producer = nodes["producer"]
    params_a = answer_ok(producer.prefill(ids_a))["kv_transfer_params"]
    params_b = answer_ok(producer.prefill(ids_b))["kv_transfer_params"]
    nodes["consumer"].send({"op": "generate", "id": "a", "prompt_ids": ids_a, "max_tokens": 4,
                            "kv_transfer_params": with_scheme(params_a, "lynx")})
    time.sleep(0.1)  # a's anchors (about 0.35 s at 0.2 Gbit/s) are on the wire
    nodes["async"].send({"op": "generate", "id": "b", "prompt_ids": ids_b, "max_tokens": 4,
                             "kv_transfer_params": with_scheme(params_b, "lynx")})
    answer_ok(nodes["consumer"].answer(120))
    answer_ok(nodes["async"].answer(120))
    a = next(r for r in nodes.records("consumer") if r["request_id"].startswith("a"))
    b = next(r for r in nodes.records("async") if r["request_id"].startswith("b"))
    assert a["error"] is None and b["error"] is None
    assert b["requested_at"] < a["lane1_done_at"], "b must ask while a's residual is still to come"
    assert b["lane0_done_at"] < a["lane1_done_at"], (a, b)  # b's anchors were not queued behind a's residual


#: A generous bound on noticing a killed producer (it takes about a second: the closed
#: connection, not a timeout), below the consumers' 30 s stream timeout it must not wait out.
NOTICED_S = 20.0


def test_a_producer_killed_mid_transfer_fails_or_recomputes_at_once(nodes: Nodes) -> None:
    """Two consumers pull from one producer, which is killed while both streams are on the wire: the
    consumer with kv_load_failure_policy=fail (a synchronous load) fails its request, the one with
    recompute (an asynchronous load) prefills the prompt itself (the same greedy text), both at once
    (not after their stream timeout), neither keeping anything of the stream."""
    ids = prompt_ids(PROMPT, seed=4)
    failing, recomputing = nodes["consumer"], nodes["async"]
    reference = answer_ok(recomputing.generate(ids, 6))["token_ids"]
    params = with_scheme(answer_ok(nodes["doomed"].prefill(ids))["kv_transfer_params"], "bf16")
    for consumer in (failing, recomputing):  # 33 MB each at 0.02 Gbit/s shared: ~26 s
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
    for name in ("consumer", "async"):
        record = [r for r in nodes.records(name) if r["request_id"].startswith("k")][-1]
        assert record["error"] is not None and record["layers_loaded"] < LAYERS, record  # nothing partial kept
    # the producer is gone now: a new request for its cache fails (or recomputes) at once
    started = time.monotonic()
    failed = failing.generate(ids, 6, kv_transfer_params=params)
    recomputed = recomputing.generate(ids, 6, kv_transfer_params=params)
    assert time.monotonic() - started < NOTICED_S  # a generous bound: its port is closed, both answer at once
    assert failed.get("error") is not None or failed["finish_reason"] == "error", failed
    assert recomputed.get("error") is None and recomputed["token_ids"] == reference, recomputed


# -- asynchronous loads ------------------------------------------------------------------------
def _largest_gap(times: list[float]) -> tuple[float, float, float]:
    """The largest gap between consecutive tokens: ``(gap, before, after)``."""
    return max(((b - a, a, b) for a, b in itertools.pairwise(times)), default=(0.0, 0.0, 0.0))


def _overlap(nodes: Nodes, mode: str, params: dict[str, Any]) -> dict[str, Any]:
    """A request decoding; once it has 10 tokens, a request whose bf16 cache takes seconds to land
    joins it. Returns both results, the load's record and the running request's largest gap."""
    consumer = nodes[MODES[mode]]
    answer = answer_ok(consumer.batch([
        {"id": "run", "prompt_ids": prompt_ids(RUNNING_PROMPT, seed=9), "max_tokens": RUNNING_TOKENS},
        {"id": "load", "prompt_ids": prompt_ids(LONG), "max_tokens": LOAD_TOKENS, "kv_transfer_params": params,
         "after": ["run", 10]},
    ], stop_after="load", then_tokens=5, timeout_s=240))
    run, load = answer["results"]["run"], answer["results"]["load"]
    assert load["error"] is None and not load["aborted"] and len(load["token_ids"]) == LOAD_TOKENS, load
    assert run["aborted"], "the running request finished before the load: it proves nothing"
    [record] = [r for r in nodes.records(MODES[mode]) if r["request_id"].startswith("load")][-1:]
    assert record["error"] is None and record["load"] == mode, record
    assert (record["layers_loaded"], record["tokens_loaded"]) == (LAYERS, LONG - 1), record  # no recompute
    transfer_s = record["last_layer_landed_at"] - record["requested_at"]
    gap, before, after = _largest_gap(run["token_times"])
    during = [t for t in run["token_times"] if record["requested_at"] < t < record["last_layer_landed_at"]]
    steps = sorted(b - a for a, b in itertools.pairwise(run["token_times"]))
    return {"run": run, "load": load, "record": record, "transfer_s": transfer_s, "gap_s": gap,
            "gap": (before, after), "tokens_during": len(during), "step_s": steps[len(steps) // 2]}


@pytest.fixture(scope="module")
def overlaps(nodes: Nodes) -> dict[str, dict[str, Any]]:
    params = answer_ok(nodes["producer"].prefill(prompt_ids(LONG)))["kv_transfer_params"]
    out = {mode: _overlap(nodes, mode, with_scheme(params, "bf16")) for mode in ("sync", "async")}
    for mode, o in out.items():
        print(f"\n{mode}: transfer {o['transfer_s']:.3f} s (pull to last layer, from the load record), "
              f"running request's largest gap between tokens {o['gap_s']:.3f} s (median {o['step_s']:.3f} s), "
              f"{o['tokens_during']} of its tokens during the transfer")
    return out


def test_a_sync_load_stalls_the_running_request_for_the_whole_transfer(
        overlaps: dict[str, dict[str, Any]], record_property: Any) -> None:
    """Token times are the driver's (when it read each token), so a token produced just before the
    pull may be read just after it: one step of slack, no more."""
    o = overlaps["sync"]
    record_property("sync_transfer_s", o["transfer_s"])
    record_property("sync_largest_gap_s", o["gap_s"])
    _, after = o["gap"]
    assert o["tokens_during"] <= 1, o["record"]  # none produced while the cache landed
    assert o["record"]["last_layer_landed_at"] <= after, o  # the gap ends once the whole cache is in
    assert o["gap_s"] + o["step_s"] >= o["transfer_s"], (o["gap_s"], o["step_s"], o["transfer_s"])


def test_an_async_load_lets_the_running_request_decode_through_the_transfer(
        overlaps: dict[str, dict[str, Any]], record_property: Any) -> None:
    o = overlaps["async"]
    record = o["record"]
    record_property("async_transfer_s", o["transfer_s"])
    record_property("async_largest_gap_s", o["gap_s"])
    assert record["last_layer_landed_at"] <= record["written_at"] <= record["reported_at"], record
    assert o["tokens_during"] > 1, record  # its tokens kept coming while the cache landed
    assert o["gap_s"] < o["transfer_s"], (o["gap_s"], o["transfer_s"])
    # the loaded request's first token followed its cache: it was scheduled once the load was reported
    assert o["load"]["first_token_at"] >= record["reported_at"]


def test_async_output_equals_sync_output_token_for_token(nodes: Nodes, overlaps: dict[str, dict[str, Any]]) -> None:
    assert overlaps["async"]["load"]["token_ids"] == overlaps["sync"]["load"]["token_ids"]
    n = min(len(overlaps[m]["run"]["token_ids"]) for m in ("sync", "async"))
    assert overlaps["async"]["run"]["token_ids"][:n] == overlaps["sync"]["run"]["token_ids"][:n]
    ids = prompt_ids(600, seed=3)
    reference = answer_ok(nodes["consumer"].generate(ids, 8))["token_ids"]  # computed locally, no connector load
    assert len(set(reference)) > 2, "the tiny model's greedy output is degenerate; the test would prove little"
    params = answer_ok(nodes["producer"].prefill(ids))["kv_transfer_params"]
    out = {(mode, s): answer_ok(nodes[MODES[mode]].generate(ids, 8, kv_transfer_params=with_scheme(params, s)))[
        "token_ids"] for s in ("bf16", "int8", "lynx") for mode in MODES}
    for s in ("bf16", "int8", "lynx"):
        assert out[("async", s)] == out[("sync", s)], s
    assert out[("async", "bf16")] == reference
    assert out[("async", "lynx")] == out[("async", "int8")]
    loads = [r for r in nodes.records("async") if r["prompt_tokens"] == 600]
    assert [r["scheme"] for r in loads] == ["bf16", "int8", "lynx"]
    assert all(r["error"] is None and r["load"] == "async" and r["layers_loaded"] == LAYERS
               and r["tokens_loaded"] == 599 for r in loads), loads


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
