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

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from lynx_bench.vllm_driver import INSTALL_HINT, free_port, numba_cache_env, vllm_python
from tests import _tiny_models

pytestmark = [pytest.mark.vllm, pytest.mark.ucx]

PYTHON = vllm_python()
if PYTHON is None:
    pytest.skip(f"the vLLM environment is not installed: {INSTALL_HINT}", allow_module_level=True)
httpx = pytest.importorskip("httpx", reason="the test client needs httpx: make install (the `test` extra)")

LAYERS = 8
#: The tiny Llama's shape for vLLM's CPU attention (head size 64), 8 layers (the connector test's).
GEOMETRY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
MODEL_NAME = "tiny"
NEW_TOKENS = 12
READY_S = 600.0   # three vLLM servers starting at once on two busy cores
ANSWER_S = 120.0
#: Prompts of a few hundred byte tokens (the tokenizer's one token per byte).
TEXTS = {
    "chat": "Anchors first, residuals later: the decode node starts as soon as the top bits land. " * 6,
    "stream": "A producer holds the prompt's cache; a consumer pulls it plane by plane over UCX. " * 6,
    "plain": "The proxy runs a one-token prefill, then the real request with the cache's address. " * 6,
}


class Server:
    """One server process (a session of its own: every ending ends all of its processes)."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.name, self.port, self.log = name, port, log
        self._out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def ready(self) -> bool:
        """Whether ``/health`` answers 200 (a probe); raises with its log if the process died."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}; its log ({self.log}):\n"
                                 f"{self.tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM to the session, up to 20 s to end, then SIGKILL to whatever of it is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # vLLM's engine core, if it outlived the server
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        self._out.close()


def _env() -> dict[str, str]:
    assert PYTHON is not None
    return {**os.environ, **numba_cache_env(PYTHON), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _vllm(name: str, model: Path, tmp: Path, transfer: dict[str, Any] | None) -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails for
    vllm-cpu: it looks up a distribution named ``vllm``)."""
    port = free_port()
    argv = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0",
            "--disable-uvicorn-access-log"]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return Server(name, argv, port, tmp / f"{name}.log", _env())


def _lynx(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_vllm.connector", "kv_role": role,
            "kv_connector_extra_config": extra, "kv_load_failure_policy": "fail"}


class Stack:
    """The plain server, the producer, the consumer and the proxy of this module."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = _tiny_models.build("llama", tmp / "tiny-llama", **GEOMETRY)
        self.loads = tmp / "consumer-loads.jsonl"
        self.producer_port = free_port()
        self.servers: list[Server] = []
        self.plain = self._add(_vllm("plain", self.model, tmp, None))
        self.producer = self._add(_vllm("producer", self.model, tmp, _lynx("kv_producer",
                                                                          {"port": self.producer_port})))
        self.consumer = self._add(_vllm("consumer", self.model, tmp, _lynx("kv_consumer",
                                                                          {"stats_path": str(self.loads)})))
        port = free_port()
        self.proxy = self._add(Server("proxy", [str(PYTHON), "-m", "lynx_vllm.proxy", "--prefill",
                                                f"127.0.0.1:{self.producer.port}", "--decode",
                                                f"127.0.0.1:{self.consumer.port}", "--port", str(port),
                                                "--timeout", str(ANSWER_S)],
                                      port, tmp / "proxy.log", _env()))
        deadline = time.monotonic() + READY_S
        waiting = list(self.servers)
        while waiting:
            waiting = [s for s in waiting if not s.ready()]
            if waiting and time.monotonic() > deadline:
                raise AssertionError(f"not ready within {READY_S:.0f} s: {[s.name for s in waiting]}; "
                                     + "; ".join(f"{s.name}'s log:\n{s.tail()}" for s in waiting))
            time.sleep(1.0)  # between probes of /health
        self.client = httpx.Client(timeout=ANSWER_S, trust_env=False)

    def _add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = None
    try:
        s = Stack(tmp_path_factory.mktemp("vllm-serve"))
        yield s
    finally:
        if s is not None:
            s.close()


def _body(kind: str, scheme: str | None) -> dict[str, Any]:
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if scheme is not None:
        common["kv_transfer_params"] = {"lynx": {"scheme": scheme}}
    if kind == "chat":
        return {**common, "messages": [{"role": "user", "content": TEXTS[kind]}]}
    return {**common, "prompt": TEXTS[kind], "stream": kind == "stream"}


def _ask(client: Any, url: str, kind: str, scheme: str | None, request_id: str) -> str:
    """The greedy text of one request (a streamed one put together from its SSE events)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    headers = {"X-Request-Id": request_id}
    if kind != "stream":
        answer = client.post(url + path, json=_body(kind, scheme), headers=headers)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return str(choice["message"]["content"] if kind == "chat" else choice["text"])
    parts = []
    with client.stream("POST", url + path, json=_body(kind, scheme), headers=headers) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                parts.extend(c["text"] for c in event["choices"])
    return "".join(parts)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("kind", ["chat", "stream", "plain"])
def test_through_the_proxy_bf16_equals_plain_vllm_and_lynx_equals_int8_all_loaded_over_lynx(
        stack: Stack, kind: str) -> None:
    reference = _ask(stack.client, stack.plain.url, kind, None, f"plain-{kind}")
    assert len(set(reference)) > 2, f"the tiny model's greedy text is degenerate ({reference!r}): it would prove little"
    out = {scheme: _ask(stack.client, stack.proxy.url, kind, scheme, f"{kind}-{scheme}")
           for scheme in ("bf16", "lynx", "int8")}
    assert out["bf16"] == reference
    assert out["lynx"] == out["int8"]
    proxied = {r["request_id"]: r for r in stack.client.get(stack.proxy.url + "/lynx/requests").json()}
    for scheme in out:  # every request's cache came over Lynx: every layer, every token but the last
        [load] = [r for r in _records(stack.loads) if f"{kind}-{scheme}" in r["request_id"]]
        assert load["error"] is None, load
        assert load["asked_scheme"] == scheme, load
        if scheme == "lynx":  # the default split, auto: a LYNX split, or INT8 when it chose none (and why)
            assert load["split_choice"] and load["scheme"] in ("lynx", "int8"), load
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
