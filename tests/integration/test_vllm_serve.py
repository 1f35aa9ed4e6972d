"""Lynx as vLLM users run it: two ``vllm.entrypoints.openai.api_server`` processes with
``--kv-transfer-config`` naming LynxConnector (a producer and a consumer), the proxy
(``python -m lynx_vllm.proxy``) in front of them, and a plain vLLM server as the reference, all
from the vLLM environment (``make vllm-env``), one thread each, a tiny random Llama with a
byte-level tokenizer (``tests/_tiny_models.py``). An ordinary HTTP client sends a chat
completion, a streaming completion and a plain completion through the proxy, once per scheme
(picked per request in ``kv_transfer_params["lynx"]``, so the servers start once).

Skipped, with the command that installs it, when the vLLM environment is absent.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.vllm_env import vllm_python_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.ucx]

PYTHON = vllm_python_or_skip()
httpx = pytest.importorskip("httpx", reason="the test client needs httpx: make install (the `test` extra)")
from tests.integration.vllm_servers import (  # noqa: E402 - after the skips
    LAYERS,
    MODEL_NAME,
    TEXTS,
    Stack,
    ask,
    records,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = None
    try:
        s = Stack(PYTHON, tmp_path_factory.mktemp("vllm-serve"))
        yield s
    finally:
        if s is not None:
            s.close()


@pytest.mark.parametrize("kind", ["chat", "stream", "plain"])
def test_through_the_proxy_bf16_equals_plain_vllm_and_lynx_equals_int8_all_loaded_over_lynx(
        stack: Stack, kind: str) -> None:
    assert stack.plain is not None
    reference = ask(stack.client, stack.plain.url, kind, None, f"plain-{kind}")
    assert len(set(reference)) > 2, f"the tiny model's greedy text is degenerate ({reference!r}): it would prove little"
    out = {scheme: ask(stack.client, stack.proxy.url, kind, scheme, f"{kind}-{scheme}")
           for scheme in ("bf16", "lynx", "int8")}
    assert out["bf16"] == reference
    assert out["lynx"] == out["int8"]
    proxied = {r["request_id"]: r for r in stack.client.get(stack.proxy.url + "/lynx/requests").json()}
    for scheme in out:  # every request's cache came over Lynx: every layer, every token but the last
        [load] = [r for r in records(stack.loads) if f"{kind}-{scheme}" in r["request_id"]]
        assert load["error"] is None, load
        assert load["asked_scheme"] == scheme, load
        if scheme == "lynx":  # the default split, auto, pulls INT8 in vLLM, and the record says why
            assert load["scheme"] == "int8" and load["split_choice"].startswith("int8 (no split)"), load
        else:
            assert load["scheme"] == scheme, load
        assert (load["layers_loaded"], load["tokens_loaded"]) == (LAYERS, load["prompt_tokens"] - 1), load
        record = proxied[f"{kind}-{scheme}"]  # the proxy's view of the same request
        assert record["error"] is None and record["remote_prefill"] and record["status"] == 200, record
        assert record["prompt_tokens"] == load["prompt_tokens"], record
        assert record["arrived_at"] < record["prefill_answered_at"] < record["decode_first_byte_at"] \
            <= record["done_at"], record


def test_the_producer_holds_only_requests_sent_for_a_remote_decode(stack: Stack) -> None:
    """vLLM's convention: a request sent to the producer directly (no do_remote_decode) is served as by
    any vLLM server and its cache is not held; the proxy's prefill leg is held."""
    body = {"model": MODEL_NAME, "prompt": TEXTS["plain"], "max_tokens": 1, "temperature": 0}
    direct = stack.client.post(stack.producer.url + "/v1/completions", json=body)
    assert direct.status_code == 200, direct.text
    assert not direct.json().get("kv_transfer_params")
    held = stack.client.post(stack.producer.url + "/v1/completions",
                             json={**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert held.status_code == 200, held.text
    assert held.json()["kv_transfer_params"]["lynx"]["producer"] == ["127.0.0.1", stack.producer_port]


def test_the_proxy_passes_models_and_health_through(stack: Stack) -> None:
    models = stack.client.get(stack.proxy.url + "/v1/models")
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL_NAME]
    assert stack.client.get(stack.proxy.url + "/health").json() == {"status": "ok", "prefill": 200, "decode": 200}
