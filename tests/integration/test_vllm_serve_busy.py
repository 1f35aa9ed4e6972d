"""``vllm serve`` on a busy machine: the producer, the consumer and the proxy of
``test_vllm_serve`` started and run with two CPU hogs (``python3 -c "while True: pass"``) beside
them the whole time, on a two-core box.

- Every request succeeds: chat, streaming and plain completions through the proxy, bf16, lynx and
  int8. Busy processes answer late; a peer is only declared dead by the liveness rule (heartbeats
  on the control channel, ``peer_timeout_s``), never for being slow. bf16 equals the consumer's own
  text for the prompt (it prefilled it itself: a plain vLLM server's answer), lynx equals int8.
- A killed producer fails the request at once (its port is closed), within 5 s with the hogs still
  running: the consumer answers the decode leg with an error, and the proxy answers a request whose
  prefill leg cannot reach the producer with a 502 naming the leg, not a hang.

Marked ``slow`` (three vLLM servers starting under load: about five minutes), out of the default
run: ``.venv/bin/python -m pytest -m slow tests/integration/test_vllm_serve_busy.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.vllm_env import vllm_python_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.ucx, pytest.mark.slow]

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

HOGS = 2
#: The issue's bound on failing a request whose producer was killed (its port closed: no timeout runs).
KILLED_S = 5.0


@pytest.fixture(scope="module")
def busy() -> Iterator[list[subprocess.Popen[bytes]]]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


@pytest.fixture(scope="module")
def stack(busy: list[subprocess.Popen[bytes]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert PYTHON is not None
    s = Stack(PYTHON, tmp_path_factory.mktemp("vllm-serve-busy"), plain=False)  # started under load
    try:
        yield s
    finally:
        s.close()


def _hogs_running(busy: list[subprocess.Popen[bytes]]) -> None:
    assert all(h.poll() is None for h in busy), "a CPU hog ended early"


def test_under_two_cpu_hogs_every_request_succeeds_and_lynx_equals_int8(
        busy: list[subprocess.Popen[bytes]], stack: Stack) -> None:
    for kind in ("chat", "stream", "plain"):
        own = ask(stack.client, stack.consumer.url, kind, None, f"own-{kind}")  # the consumer prefills itself
        out = {scheme: ask(stack.client, stack.proxy.url, kind, scheme, f"{kind}-{scheme}")
               for scheme in ("bf16", "lynx", "int8")}
        assert out["bf16"] == own, kind
        assert out["lynx"] == out["int8"], kind
        for scheme in out:  # each loaded over Lynx, all of it, no error
            [load] = [r for r in records(stack.loads) if f"{kind}-{scheme}" in r["request_id"]]
            assert load["error"] is None, load
            assert (load["layers_loaded"], load["tokens_loaded"]) == (LAYERS, load["prompt_tokens"] - 1), load
    _hogs_running(busy)


def _prefill(stack: Stack) -> dict[str, Any]:
    """The proxy's prefill leg, sent by hand: the producer holds the cache and says where it is."""
    answer = stack.client.post(stack.producer.url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": TEXTS["plain"], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params and params["lynx"]["producer"][1] == stack.producer_port, params
    return dict(params)


def test_a_killed_producer_fails_the_request_at_once_and_the_proxy_answers_an_error(
        busy: list[subprocess.Popen[bytes]], stack: Stack) -> None:
    params = _prefill(stack)
    stack.producer.stop()  # SIGTERM, then SIGKILL to whatever is left: its Lynx port closes with it
    decode = {"model": MODEL_NAME, "prompt": TEXTS["plain"], "max_tokens": 4, "temperature": 0,
              "kv_transfer_params": params}
    start = time.monotonic()
    answer = stack.client.post(stack.consumer.url + "/v1/completions", json=decode)
    took = time.monotonic() - start
    failed = answer.status_code >= 400 or answer.json()["choices"][0].get("finish_reason") == "error"
    assert failed, answer.text
    assert took < KILLED_S, f"the consumer took {took:.2f} s to fail a load from a dead producer"
    [load] = [r for r in records(stack.loads) if r.get("error")][-1:]
    assert load["layers_loaded"] == 0, load  # nothing of the dead producer's cache is kept
    start = time.monotonic()
    plain = {k: v for k, v in decode.items() if k != "kv_transfer_params"}  # a client's request
    proxied = stack.client.post(stack.proxy.url + "/v1/completions", json=plain)
    took_proxy = time.monotonic() - start
    assert proxied.status_code == 502 and "prefill" in proxied.text, proxied.text
    assert took_proxy < KILLED_S, f"the proxy took {took_proxy:.2f} s to answer with the producer gone"
    _hogs_running(busy)
    print(f"killed producer: the consumer failed the load in {took:.2f} s, the proxy answered 502 in "
          f"{took_proxy:.2f} s, with {HOGS} CPU hogs running")
