"""The disaggregated proxy (lynx_vllm.proxy): the real app, served by uvicorn on 127.0.0.1, in
front of two stand-in vLLM servers (Starlette apps in threads, or a socket that never answers)
that record what each leg was sent. The pure parts (what each leg is sent, the settings) need
none of FastAPI, uvicorn, httpx; the HTTP tests are skipped, with what to install, without them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lynx_decode.codec.config import Scheme
from lynx_vllm.errors import ConnectorError, LegError
from lynx_vllm.proxy import INSTALL_HINT, Codec, ProxyConfig, StatsLog, Upstream, create_app
from lynx_vllm.proxy.__main__ import parse_args
from lynx_vllm.proxy.legs import client_codec, decode_body, error_excerpt, leg_status_error, prefill_body

MISSING = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
needs_http = pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: {INSTALL_HINT} "
                                                      "(the `test` extra has them: make install)")

#: What the stand-in producer answers in kv_transfer_params (LynxConnector's shape, plus vLLM's flags).
PRODUCER_PARAMS = {"lynx": {"producer": ["10.0.0.2", 14600], "prompt_tokens": 7},
                   "do_remote_prefill": True, "do_remote_decode": False}
#: A bound on every wait of a test (never reached when the code is right).
WAIT_S = 20.0


# -- the pure parts ------------------------------------------------------------------------------
def test_prefill_body_is_one_token_no_stream_do_remote_decode_and_leaves_the_client_body_alone() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3, "temperature": 0,
            "kv_transfer_params": {"lynx": {"scheme": "int8"}}}
    before = json.loads(json.dumps(body))
    out = prefill_body(body)
    assert out == {"model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                   "temperature": 0, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    assert body == before
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"})  # set only where the client set it


def test_decode_body_carries_the_prefill_params_with_only_the_codec_set() -> None:
    body = {"prompt": "hi", "max_tokens": 5, "stream": True, "kv_transfer_params": {"lynx": {"scheme": "int8"}}}
    out = decode_body(body, PRODUCER_PARAMS, Codec(Scheme.LYNX, (3, 5)))
    assert out["kv_transfer_params"] == {**PRODUCER_PARAMS, "lynx": {**PRODUCER_PARAMS["lynx"], "scheme": "lynx",
                                                                     "planes": [3, 5]}}
    assert (out["max_tokens"], out["stream"]) == (5, True)
    assert PRODUCER_PARAMS["lynx"] == {"producer": ["10.0.0.2", 14600], "prompt_tokens": 7}  # not changed
    assert decode_body(body, PRODUCER_PARAMS, Codec())["kv_transfer_params"] == PRODUCER_PARAMS
    assert "kv_transfer_params" not in decode_body(body, None, Codec(Scheme.INT8))  # the consumer prefills
    nixl = {"do_remote_prefill": True, "remote_engine_id": "e"}  # no "lynx" entry: nothing to set
    assert decode_body(body, nixl, Codec(Scheme.INT8))["kv_transfer_params"] == nixl


def test_a_clients_codec_beats_the_proxys_key_by_key() -> None:
    default = Codec(Scheme.LYNX, (3, 5))
    assert client_codec({}).over(default) == default
    assert client_codec({"kv_transfer_params": {"lynx": {"scheme": "INT8"}}}).over(default) == Codec(Scheme.INT8)
    assert client_codec({"kv_transfer_params": {"lynx": {"planes": "2,2,4"}}}).over(default) \
        == Codec(Scheme.LYNX, (2, 2, 4))
    assert client_codec({"kv_transfer_params": {"lynx": {"planes": [4, 4]}}}).over(Codec()) == Codec(None, (4, 4))
    for bad, message in (({"scheme": "fp8"}, "scheme must be one of"), ({"planes": "4,5"}, "planes:"),
                         ({"scheme": "int8", "planes": "4,4"}, "planes only apply to the lynx scheme")):
        with pytest.raises(ConnectorError, match=message):
            client_codec({"kv_transfer_params": {"lynx": bad}})


def test_an_upstream_error_keeps_its_reason_and_a_4xx_stays_a_4xx() -> None:
    vllm_error = json.dumps({"error": {"message": "This model's maximum context length is 4096", "code": 400}})
    error = leg_status_error("prefill", 400, "Bad Request", vllm_error)
    assert (error.status, error.leg, error.kind) == (400, "prefill", "invalid_request_error")
    assert str(error) == "prefill leg: 400 Bad Request: This model's maximum context length is 4096"
    error = leg_status_error("decode", 500, "Internal Server Error", "boom " * 200)
    assert error.status == 502 and str(error).startswith("decode leg: 500 Internal Server Error: boom boom")
    assert len(str(error)) < 400
    assert error.body()["error"] == {"message": str(error), "type": "upstream_error", "code": 502, "leg": "decode"}
    assert error_excerpt(json.dumps({"detail": "Not Found"})) == "Not Found"
    assert error_excerpt(json.dumps({"object": "error", "message": "no such model"})) == "no such model"


def test_settings_from_the_command_line() -> None:
    config, _ = parse_args(["--prefill", "10.0.0.2:8100", "--decode", "http://[::1]:8200/", "--scheme", "lynx",
                            "--planes", "2,2,4", "--timeout", "7"])
    assert config.prefill == Upstream("10.0.0.2", 8100) and config.decode.url == "http://[::1]:8200"
    assert (config.codec, config.timeout_s) == (Codec(Scheme.LYNX, (2, 2, 4)), 7.0)
    for argv in (["--prefill", "nohost", "--decode", "h:1"], ["--prefill", "h:1", "--decode", "h:1", "--scheme",
                 "int8", "--planes", "4,4"], ["--prefill", "h:1", "--decode", "h:1", "--timeout", "0"],
                 ["--prefill", "h:1", "--decode", "h:1", "--scheme", "fp16"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


# -- the stand-in servers ---------------------------------------------------------------------------
class Servers:
    """Apps served by uvicorn on 127.0.0.1 (free ports), each in a thread; all stopped at once."""

    def __init__(self) -> None:
        self._running: list[tuple[Any, threading.Thread]] = []

    def serve(self, app: Any) -> str:
        """Serve ``app``; its ``HOST:PORT`` once it listens."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, log_level="warning",
                                               access_log=False, ws="none", lifespan="on",
                                               timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
        thread.start()
        self._running.append((server, thread))
        deadline = time.monotonic() + WAIT_S
        while not server.started:  # a probe, bounded
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.005)
        return f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        for server, _ in self._running:
            server.should_exit = True
        for _, thread in self._running:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "uvicorn did not stop"


class StandIn:
    """A stand-in vLLM server: records every request (path, headers, JSON body) and answers like a
    producer (``kv_transfer_params``) or a consumer (a completion; an SSE stream when asked, whose
    second event waits for :attr:`release`). ``status``: answer that error instead."""

    def __init__(self, role: str) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        self.role = role
        self.received: list[dict[str, Any]] = []
        self.status = 200
        self.release = threading.Event()
        self.second_sent = threading.Event()

        async def completion(request: Any) -> Response:
            body = await request.json()
            self.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            if self.status != 200:
                return JSONResponse({"error": {"message": f"stand-in {role} failed", "code": self.status}},
                                    status_code=self.status)
            if role == "prefill":
                return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": PRODUCER_PARAMS})
            if body.get("stream"):
                return StreamingResponse(self._events(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"text": "hello world"}], "seen": body.get("kv_transfer_params")})

        async def health(request: Any) -> Response:
            return Response(status_code=self.status)

        async def models(request: Any) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": f"{role}-model"}]})

        self.app = Starlette(routes=[Route("/v1/completions", completion, methods=["POST"]),
                                     Route("/v1/chat/completions", completion, methods=["POST"]),
                                     Route("/health", health), Route("/v1/models", models)])

    async def _events(self) -> Any:
        import anyio

        yield b'data: {"choices": [{"text": "hello"}]}\n\n'
        with anyio.move_on_after(WAIT_S):
            while not self.release.is_set():
                await anyio.sleep(0.01)
        self.second_sent.set()
        yield b'data: {"choices": [{"text": " world"}]}\n\n'
        yield b"data: [DONE]\n\n"


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A port that takes connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


class Rig:
    def __init__(self, url: str, prefill: StandIn, decode: StandIn, stats: StatsLog) -> None:
        import httpx

        self.url, self.prefill, self.decode, self.stats = f"http://{url}", prefill, decode, stats
        self.client = httpx.Client(base_url=self.url, timeout=WAIT_S, trust_env=False)


@contextlib.contextmanager
def rig(*, prefill_at: str | None = None, decode_at: str | None = None, **config: Any) -> Iterator[Rig]:
    """The proxy in front of two stand-ins (or the given addresses instead of either)."""
    prefill, decode = StandIn("prefill"), StandIn("decode")
    servers = Servers()
    try:
        p = prefill_at or servers.serve(prefill.app)
        d = decode_at or servers.serve(decode.app)
        stats = StatsLog(ring=8, path=config.pop("stats_path", None))
        proxy = create_app(ProxyConfig(Upstream.parse(p), Upstream.parse(d), **config), stats=stats)
        r = Rig(servers.serve(proxy), prefill, decode, stats)
        try:
            yield r
        finally:
            r.client.close()
    finally:
        decode.release.set()
        servers.stop()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20,
        "min_tokens": 2, "temperature": 0}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 20, "temperature": 0}


# -- the HTTP tests ------------------------------------------------------------------------------
@needs_http
@pytest.mark.parametrize(("endpoint", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_the_legs_follow_vllms_convention_with_one_request_id(endpoint: str, body: dict[str, Any]) -> None:
    with rig() as r:
        answer = r.client.post(endpoint, json=body, headers={"X-Request-Id": "req-42", "Authorization": "Bearer k"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "hello world"
        assert answer.headers["x-request-id"] == "req-42"
        [p], [d] = r.prefill.received, r.decode.received
    assert (p["path"], d["path"]) == (endpoint, endpoint)
    assert p["body"] == prefill_body(body)  # one token, no stream, do_remote_decode; min_tokens dropped
    assert p["body"]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert d["body"] == {**body, "kv_transfer_params": PRODUCER_PARAMS}  # the client's, with P's params as they came
    for leg in (p, d):
        assert leg["headers"]["x-request-id"] == "req-42"
        assert leg["headers"]["authorization"] == "Bearer k"


@needs_http
def test_a_fresh_request_id_when_the_client_gives_none_and_the_codec_reaches_the_decode_leg() -> None:
    with rig(codec=Codec(Scheme.LYNX, (3, 5))) as r:
        assert r.client.post("/v1/completions", json=COMPLETION).status_code == 200
        picked = {**COMPLETION, "kv_transfer_params": {"lynx": {"scheme": "int8"}}}
        assert r.client.post("/v1/completions", json=picked).status_code == 200
        bad = r.client.post("/v1/completions", json={**COMPLETION, "kv_transfer_params": {"lynx": {"scheme": "x"}}})
        (p1, p2), (d1, d2) = r.prefill.received, r.decode.received
    assert p1["headers"]["x-request-id"] == d1["headers"]["x-request-id"] != p2["headers"]["x-request-id"]
    assert len(p1["headers"]["x-request-id"]) == 36  # a uuid
    assert d1["body"]["kv_transfer_params"]["lynx"] == {**PRODUCER_PARAMS["lynx"], "scheme": "lynx", "planes": [3, 5]}
    assert d2["body"]["kv_transfer_params"]["lynx"] == {**PRODUCER_PARAMS["lynx"], "scheme": "int8"}
    assert p2["body"]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert bad.status_code == 400 and "scheme must be one of" in bad.json()["error"]["message"]  # no leg ran


@needs_http
def test_a_stream_is_relayed_as_it_comes() -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with rig() as r:
        lines = []
        with r.client.stream("POST", "/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            for line in answer.iter_lines():
                if not line:
                    continue
                if not lines:  # the first event is here while the stand-in still holds the second
                    assert not r.decode.second_sent.is_set(), "the proxy buffered the stream"
                    r.decode.release.set()
                lines.append(line)
        [p], [d] = r.prefill.received, r.decode.received
    assert lines == ['data: {"choices": [{"text": "hello"}]}', 'data: {"choices": [{"text": " world"}]}',
                     "data: [DONE]"]
    assert p["body"]["stream"] is False and "stream_options" not in p["body"]
    assert d["body"]["stream"] is True and d["body"]["stream_options"] == {"include_usage": True}
    [record] = r.stats.records()
    assert record["stream"] and record["error"] is None
    assert record["decode_sent_at"] <= record["decode_first_byte_at"] <= record["done_at"]


@needs_http
@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize(("upstream", "client"), [(500, 502), (503, 502), (400, 400)])
def test_an_upstream_error_is_a_clear_error_naming_the_leg(leg: str, upstream: int, client: int) -> None:
    with rig() as r:
        getattr(r, leg).status = upstream
        answer = r.client.post("/v1/completions", json=COMPLETION)
        decode_ran = bool(r.decode.received)
    assert answer.status_code == client
    error = answer.json()["error"]
    assert error["leg"] == leg and error["code"] == client
    assert error["message"].startswith(f"{leg} leg: {upstream} ") and f"stand-in {leg} failed" in error["message"]
    assert decode_ran == (leg == "decode")  # a failed prefill never reaches the decode server
    [record] = r.stats.records()
    assert (record["failed_leg"], record["status"]) == (leg, client)


@needs_http
@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_an_unreachable_upstream_is_a_502(leg: str) -> None:
    with rig(**{f"{leg}_at": _closed_port()}) as r:
        answer = r.client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert (error["leg"], error["type"]) == (leg, "upstream_unreachable")
    assert "ConnectError" in error["message"]


@needs_http
@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_that_never_answers_is_a_504_within_the_timeout(leg: str, stream: bool) -> None:
    timeout_s = 0.5
    with silent_server() as silent, rig(**{f"{leg}_at": silent}, timeout_s=timeout_s) as r:
        started = time.monotonic()
        answer = r.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
        took = time.monotonic() - started
    assert answer.status_code == 504, answer.text
    error = answer.json()["error"]
    assert (error["leg"], error["type"]) == (leg, "upstream_timeout")
    assert "within 0.5 s" in error["message"]
    assert took < 10 * timeout_s, took  # it did not hang (a cause, not a duration: the bound is 10x)


@needs_http
def test_health_models_and_the_request_records(tmp_path: Any) -> None:
    path = tmp_path / "proxy.jsonl"
    with rig(stats_path=str(path)) as r:
        assert r.client.get("/health").json() == {"status": "ok", "prefill": 200, "decode": 200}
        assert r.client.get("/v1/models").json()["data"] == [{"id": "decode-model"}]
        r.decode.status = 503
        health = r.client.get("/health")
        assert (health.status_code, health.json()["decode"]) == (503, 503)
        r.decode.status = 200
        for i in range(10):
            assert r.client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": f"r{i}"}).status_code \
                == 200
        kept = r.client.get("/lynx/requests").json()
    assert [k["request_id"] for k in kept] == [f"r{i}" for i in range(2, 10)]  # the ring keeps the last 8
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [k["request_id"] for k in lines] == [f"r{i}" for i in range(10)]  # the file keeps them all
    k = lines[-1]
    assert k["arrived_at"] <= k["prefill_sent_at"] <= k["prefill_answered_at"] <= k["decode_sent_at"] \
        <= k["decode_first_byte_at"] <= k["done_at"]
    assert (k["prefill_status"], k["decode_status"], k["status"], k["prompt_tokens"], k["remote_prefill"]) \
        == (200, 200, 200, 7, True)


@needs_http
def test_a_health_probe_names_an_unreachable_leg() -> None:
    with rig(prefill_at=_closed_port()) as r:
        health = r.client.get("/health")
    assert health.status_code == 503
    assert health.json()["decode"] == 200 and health.json()["prefill"].startswith("prefill leg: http://127.0.0.1:")


def test_leg_error_is_a_connector_error() -> None:
    assert issubclass(LegError, ConnectorError)


def test_importing_the_proxy_imports_no_web_framework() -> None:
    """``import lynx_vllm.proxy`` (and its command line's parsing) works where only ``lynx-kv[ucx]`` is
    installed: FastAPI, uvicorn and httpx are imported by create_app and main only."""
    code = ("import sys, lynx_vllm.proxy, lynx_vllm.proxy.__main__ as m; m.parse_args(['--prefill', 'h:1', "
            "'--decode', 'h:2']); print(sorted({n.split('.')[0] for n in sys.modules} & "
            "{'fastapi', 'starlette', 'uvicorn', 'httpx', 'vllm', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out
