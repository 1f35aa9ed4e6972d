"""Real vLLM OpenAI servers for the serving tests: one ``api_server`` process (or the proxy) per
:class:`Server`, each in a session of its own, one thread, from the vLLM environment."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from lynx_bench.vllm.bench_servers import Server  # one server process, as the benchmark runs it
from lynx_bench.vllm.driver import free_port, numba_cache_env
from tests import _tiny_models

__all__ = ["Server", "Stack", "server_env", "vllm_server", "lynx_transfer", "ask", "body", "records", "MODEL_NAME",
           "LAYERS", "TEXTS"]

MODEL_NAME = "tiny"
LAYERS = 8
#: The tiny Llama's shape for vLLM's CPU attention (head size 64), 8 layers (the connector test's).
GEOMETRY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
NEW_TOKENS = 12
READY_S = 600.0   # three vLLM servers starting at once on two busy cores
ANSWER_S = 120.0
#: Prompts of a few hundred byte tokens (the tokenizer's one token per byte).
TEXTS = {
    "chat": "Anchors first, residuals later: the decode node starts as soon as the top bits land. " * 6,
    "stream": "A producer holds the prompt's cache; a consumer pulls it plane by plane over UCX. " * 6,
    "plain": "The proxy runs a one-token prefill, then the real request with the cache's address. " * 6,
}


def server_env(python: Path) -> dict[str, str]:
    """The environment of every server: one thread, no CPU binding, offline."""
    return {**os.environ, **numba_cache_env(python), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def vllm_server(python: Path, name: str, model: Path, tmp: Path, transfer: dict[str, Any] | None) -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails for
    vllm-cpu: it looks up a distribution named ``vllm``)."""
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0",
            "--disable-uvicorn-access-log"]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return Server(name, argv, port, tmp / f"{name}.log", server_env(python))


def lynx_transfer(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A ``--kv-transfer-config`` naming LynxConnector (failures fail the request)."""
    return {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynx_vllm.connector", "kv_role": role,
            "kv_connector_extra_config": extra, "kv_load_failure_policy": "fail"}


class Stack:
    """A producer, a consumer (LynxConnector, ``consumer_extra`` added to its settings), the proxy
    in front of them and, with ``plain``, a plain vLLM server, all started at once and ready."""

    def __init__(self, python: Path, tmp: Path, *, plain: bool = True,
                 consumer_extra: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        self.model = _tiny_models.build("llama", tmp / "tiny-llama", **GEOMETRY)
        self.loads = tmp / "consumer-loads.jsonl"
        self.producer_port = free_port()
        self.servers: list[Server] = []
        self.plain = self._add(vllm_server(python, "plain", self.model, tmp, None)) if plain else None
        self.producer = self._add(vllm_server(python, "producer", self.model, tmp,
                                              lynx_transfer("kv_producer", {"port": self.producer_port})))
        extra = {"stats_path": str(self.loads), **(consumer_extra or {})}
        self.consumer = self._add(vllm_server(python, "consumer", self.model, tmp,
                                              lynx_transfer("kv_consumer", extra)))
        port = free_port()
        self.proxy = self._add(Server("proxy", [str(python), "-m", "lynx_vllm.proxy", "--prefill",
                                                f"127.0.0.1:{self.producer.port}", "--decode",
                                                f"127.0.0.1:{self.consumer.port}", "--port", str(port),
                                                "--timeout", str(ANSWER_S)],
                                      port, tmp / "proxy.log", server_env(python)))
        try:
            self._wait_ready()
        except BaseException:
            self.close()  # every server started so far, not only on success
            raise
        self.client = httpx.Client(timeout=ANSWER_S, trust_env=False)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        waiting = list(self.servers)
        while waiting:
            waiting = [s for s in waiting if not s.ready()]
            if waiting and time.monotonic() > deadline:
                raise AssertionError(f"not ready within {READY_S:.0f} s: {[s.name for s in waiting]}; "
                                     + "; ".join(f"{s.name}'s log:\n{s.tail()}" for s in waiting))
            time.sleep(1.0)  # between probes of /health

    def _add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        for server in reversed(self.servers):
            server.stop()


def body(kind: str, scheme: str | None) -> dict[str, Any]:
    """The OpenAI request of ``kind`` (chat, stream, plain), greedy, asking for ``scheme`` (None: the
    consumer's default; a plain server ignores it)."""
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if scheme is not None:
        common["kv_transfer_params"] = {"lynx": {"scheme": scheme}}
    if kind == "chat":
        return {**common, "messages": [{"role": "user", "content": TEXTS[kind]}]}
    return {**common, "prompt": TEXTS[kind], "stream": kind == "stream"}


def ask(client: Any, url: str, kind: str, scheme: str | None, request_id: str) -> str:
    """The greedy text of one request (a streamed one put together from its SSE events)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    headers = {"X-Request-Id": request_id}
    if kind != "stream":
        answer = client.post(url + path, json=body(kind, scheme), headers=headers)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return str(choice["message"]["content"] if kind == "chat" else choice["text"])
    parts = []
    with client.stream("POST", url + path, json=body(kind, scheme), headers=headers) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                parts.extend(c["text"] for c in event["choices"])
    return "".join(parts)


def records(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records (none while it does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
