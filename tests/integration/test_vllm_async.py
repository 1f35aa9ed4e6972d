"""Asynchronous loads (``load: "async"``) inside real vLLM (CPU): a producer and two consumers,
one loading synchronously (the default), one asynchronously, in processes of their own from the
vLLM environment (``make vllm-env``), driven by :mod:`lynx_bench.vllm.driver`.

The claim: a long transfer (Lynx's own shaper holds the producer to 0.2 Gbit/s) that lands while
another request is decoding stalls that request in sync mode (the forward that waits inside its
layers for the new request's cache is the running request's forward too) and does not in async
mode (a Lynx thread writes the layers while the engine keeps stepping). Asserted as a cause:
the running request's largest gap between tokens against the transfer time from the same
load's record (``stats_path``), both on this host's wall clock; never against a fixed duration.
And the output of an asynchronous load is a synchronous load's, token for token (greedy).

A tiny randomly initialised Llama with a wide cache (8 layers, 8 KV heads of 64), built here with
transformers (no download). Skipped, with the command that installs it, when the vLLM
environment is absent.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lynx_bench.vllm.driver import VllmNode, free_port
from tests.integration.vllm_env import vllm_python_or_skip
from tests.integration.vllm_models import (
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
#: The loaded prompt: 4000 tokens x 8 layers x 8 KV heads x 64 x 2 (K, V) x 2 bytes = 65 MB of
#: bf16 cache, about 2.6 s at 0.2 Gbit/s; a running request decodes meanwhile.
LONG = 4000
RUNNING_PROMPT = 32
RUNNING_TOKENS = 3500  # more than it can decode while the load lands; aborted soon after the load ends
LOAD_TOKENS = 6


class Nodes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        model = tiny_llama(tmp / "tiny-llama-wide", layers=LAYERS, kv_heads=8)
        self.specs: dict[str, dict[str, Any]] = {
            "producer": dict(role="kv_producer", extra={"port": free_port(), "bandwidth_gbps": LINK_GBPS}),
            "sync": dict(role="kv_consumer", extra={"stats_path": str(tmp / "sync.jsonl")}),
            "async": dict(role="kv_consumer", extra={"stats_path": str(tmp / "async.jsonl"), "load": "async"}),
        }
        # unbound (start_instances' default): vLLM's CPU worker would bind itself, and so every
        # Lynx thread it starts, to CPU 0, where an async load's receiver would share one core
        # with the worker's spinning step loop
        self.nodes: dict[str, VllmNode] = start_instances(PYTHON, model, tmp, self.specs, ready_timeout_s=600)

    def __getitem__(self, name: str) -> VllmNode:
        return self.nodes[name]

    def records(self, mode: str) -> list[dict[str, Any]]:
        return load_records(self.tmp / f"{mode}.jsonl")

    def close(self) -> None:
        close_all(self.nodes.values())


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    n = Nodes(tmp_path_factory.mktemp("vllm-async"))
    yield n
    n.close()


def _largest_gap(times: list[float]) -> tuple[float, float, float]:
    """The largest gap between consecutive tokens: ``(gap, before, after)``."""
    return max(((b - a, a, b) for a, b in itertools.pairwise(times)), default=(0.0, 0.0, 0.0))


def _overlap(nodes: Nodes, mode: str, params: dict[str, Any]) -> dict[str, Any]:
    """A request decoding; once it has 10 tokens, a request whose bf16 cache takes seconds to land
    joins it. Returns both results, the load's record and the running request's largest gap."""
    consumer = nodes[mode]
    answer = answer_ok(consumer.batch([
        {"id": "run", "prompt_ids": prompt_ids(RUNNING_PROMPT, seed=9), "max_tokens": RUNNING_TOKENS},
        {"id": "load", "prompt_ids": prompt_ids(LONG), "max_tokens": LOAD_TOKENS, "kv_transfer_params": params,
         "after": ["run", 10]},
    ], stop_after="load", then_tokens=5, timeout_s=240))
    run, load = answer["results"]["run"], answer["results"]["load"]
    assert load["error"] is None and not load["aborted"] and len(load["token_ids"]) == LOAD_TOKENS, load
    assert run["aborted"], "the running request finished before the load: it proves nothing"
    [record] = [r for r in nodes.records(mode) if r["request_id"].startswith("load")][-1:]
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
    reference = answer_ok(nodes["sync"].generate(ids, 8))["token_ids"]  # computed locally, no connector load
    assert len(set(reference)) > 2, "the tiny model's greedy output is degenerate; the test would prove little"
    params = answer_ok(nodes["producer"].prefill(ids))["kv_transfer_params"]
    out = {(mode, s): answer_ok(nodes[mode].generate(ids, 8, kv_transfer_params=with_scheme(params, s)))["token_ids"]
           for s in ("bf16", "int8", "lynx") for mode in ("sync", "async")}
    for s in ("bf16", "int8", "lynx"):
        assert out[("async", s)] == out[("sync", s)], s
    assert out[("async", "bf16")] == reference
    assert out[("async", "lynx")] == out[("async", "int8")]
    loads = [r for r in nodes.records("async") if r["prompt_tokens"] == 600]
    assert [r["scheme"] for r in loads] == ["bf16", "int8", "lynx"]
    assert all(r["error"] is None and r["load"] == "async" and r["layers_loaded"] == LAYERS
               and r["tokens_loaded"] == 599 for r in loads), loads
