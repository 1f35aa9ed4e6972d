"""The proxy's HTTP side: a FastAPI app in front of a producer and a consumer vLLM server.

``POST /v1/completions`` and ``POST /v1/chat/completions`` run the two legs of
:mod:`lynx_vllm.proxy.legs` and relay the decode leg's answer as it comes (an SSE stream stays a
stream); ``GET /v1/models`` is the decode server's; ``GET /health`` is 200 when both servers'
``/health`` are; ``GET /lynx/requests`` lists the last requests' timestamps
(:class:`~lynx_vllm.proxy.stats.RequestTimes`). Both legs carry the same ``X-Request-Id`` (the
client's, or a fresh uuid), and the client's ``Authorization`` header.

Errors: a leg that cannot be reached or answers a server error is a 502 (a 4xx it answers stays
that 4xx), one that does not answer within ``timeout_s`` a 504, each with an OpenAI-style body
naming the leg and the reason (:class:`~lynx_vllm.errors.LegError`); a bad body is a 400 before
any leg. A decode stream that breaks after it started cannot change its status: an SSE stream gets
one ``data: {"error": ...}`` event, any other body is cut (the client sees an incomplete read).

Concurrency: asyncio, on uvicorn's one event loop; one ``httpx.AsyncClient`` (a connection pool)
per leg, made in the app's lifespan, blind to ``HTTP_PROXY`` and the like (the legs go direct).
This is the one module of the proxy that imports FastAPI and httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lynx_vllm.errors import ConnectorError, LegError
from lynx_vllm.proxy.legs import ProxyConfig, Upstream, client_codec, decode_body, leg_status_error, prefill_body
from lynx_vllm.proxy.stats import RequestTimes, StatsLog

__all__ = ["create_app"]

log = logging.getLogger("lynx_vllm.proxy")


def _bad_request(rid: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 400}},
                        status_code=400, headers={"X-Request-Id": rid})


class _Legs:
    """The two upstreams' clients and what happens on each leg."""

    def __init__(self, config: ProxyConfig, stats: StatsLog) -> None:
        self.config = config
        self.stats = stats
        self.clients: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        timeout = httpx.Timeout(self.config.timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with contextlib.AsyncExitStack() as stack:
            for leg, upstream in (("prefill", self.config.prefill), ("decode", self.config.decode)):
                self.clients[leg] = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=upstream.url, timeout=timeout, limits=limits, trust_env=False))
            yield
        self.clients.clear()

    def _upstream(self, leg: str) -> Upstream:
        return self.config.prefill if leg == "prefill" else self.config.decode

    def _transport_error(self, leg: str, exc: BaseException) -> LegError:
        url = self._upstream(leg).url
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
            return LegError(leg, 504, "upstream_timeout",
                            f"no answer from {url} within {self.config.timeout_s:g} s ({type(exc).__name__})")
        return LegError(leg, 502, "upstream_unreachable", f"{url}: {type(exc).__name__}: {exc}")

    def done(self, times: RequestTimes) -> None:
        times.done_at = times.done_at or time.time()
        self.stats.add(times)
        quiet = times.error is None and (times.remote_prefill or times.prefill_status is None)
        log.log(logging.INFO if quiet else logging.WARNING, "%s", times.summary())

    async def prefill(self, endpoint: str, body: dict[str, Any], headers: Mapping[str, str],
                      times: RequestTimes) -> dict[str, Any] | None:
        """Run the prefill leg; its answer's ``kv_transfer_params`` (None if it has none)."""
        times.prefill_sent_at = time.time()
        try:
            response = await asyncio.wait_for(self.clients["prefill"].post(endpoint, json=body, headers=headers),
                                              self.config.timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError) as exc:
            raise self._transport_error("prefill", exc) from exc
        times.prefill_answered_at = time.time()
        times.prefill_status = response.status_code
        if not response.is_success:
            raise leg_status_error("prefill", response.status_code, response.reason_phrase, response.text)
        try:
            data = response.json()
        except ValueError:
            raise LegError("prefill", 502, "upstream_error",
                           f"the answer is not JSON: {response.text[:200]!r}") from None
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict) or not params:
            return None
        times.remote_prefill = True
        lynx = params.get("lynx")
        if isinstance(lynx, dict) and isinstance(lynx.get("prompt_tokens"), int):
            times.prompt_tokens = lynx["prompt_tokens"]
        return params

    async def open_decode(self, endpoint: str, body: dict[str, Any], headers: Mapping[str, str],
                          times: RequestTimes) -> httpx.Response:
        """Send the decode leg and wait for its response headers; the open response (2xx)."""
        params = body.get("kv_transfer_params")
        lynx = params.get("lynx") if isinstance(params, dict) else None
        if isinstance(lynx, dict):
            times.scheme, times.planes = lynx.get("scheme"), lynx.get("planes")
        client = self.clients["decode"]
        times.decode_sent_at = time.time()
        try:
            response = await asyncio.wait_for(
                client.send(client.build_request("POST", endpoint, json=body, headers=headers), stream=True),
                self.config.timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError) as exc:
            raise self._transport_error("decode", exc) from exc
        times.decode_status = response.status_code
        if response.is_success:
            return response
        try:
            text = (await asyncio.wait_for(response.aread(), self.config.timeout_s)).decode(errors="replace")
        except (asyncio.TimeoutError, httpx.HTTPError):
            text = ""
        finally:
            await response.aclose()
        raise leg_status_error("decode", response.status_code, response.reason_phrase, text)

    async def relay(self, response: httpx.Response, times: RequestTimes) -> AsyncIterator[bytes]:
        """The decode leg's body, chunk by chunk as it comes; records the request when it ends."""
        sse = "text/event-stream" in response.headers.get("content-type", "")
        try:
            async for chunk in response.aiter_bytes():
                if times.decode_first_byte_at is None:
                    times.decode_first_byte_at = time.time()
                yield chunk
        except httpx.HTTPError as exc:
            error = self._transport_error("decode", exc)
            error = LegError("decode", error.status, error.kind, f"the answer broke off: {error.args[0]}")
            times.error, times.failed_leg = str(error), "decode"
            if not sse:
                raise
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        except BaseException:  # the client went away (cancelled): the decode server hears of it below
            times.error = times.error or "the client went away before the answer ended"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
            self.done(times)

    async def get(self, leg: str, path: str) -> httpx.Response:
        try:
            return await asyncio.wait_for(self.clients[leg].get(path), self.config.timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError) as exc:
            raise self._transport_error(leg, exc) from exc


async def _forward(legs: _Legs, request: Request, endpoint: str) -> Response:
    """One completion request through both legs: a 400 for a bad body, the leg's error as an
    OpenAI-style body, or the decode leg's answer relayed as it comes."""
    rid = request.headers.get("x-request-id") or str(uuid.uuid4())
    times = RequestTimes(rid, endpoint, False, time.time())
    try:
        body = await request.json()
    except ValueError:
        return _bad_request(rid, "the request body is not JSON")
    if not isinstance(body, dict):
        return _bad_request(rid, "the request body must be a JSON object")
    times.stream = bool(body.get("stream"))
    try:
        codec = client_codec(body).over(legs.config.codec)
    except ConnectorError as exc:
        return _bad_request(rid, f"kv_transfer_params.lynx: {exc}")
    headers = {"X-Request-Id": rid}
    if "authorization" in request.headers:
        headers["Authorization"] = request.headers["authorization"]
    try:
        params = await legs.prefill(endpoint, prefill_body(body), headers, times)
        response = await legs.open_decode(endpoint, decode_body(body, params, codec), headers, times)
    except LegError as exc:
        times.error, times.failed_leg, times.status = str(exc), exc.leg, exc.status
        legs.done(times)
        return JSONResponse(exc.body(), status_code=exc.status, headers={"X-Request-Id": rid})
    except BaseException as exc:  # recorded, then up to uvicorn (a cancel: the client went away)
        times.error = ("cancelled: the client went away" if isinstance(exc, asyncio.CancelledError)
                       else f"{type(exc).__name__}: {exc}")
        legs.done(times)
        raise
    times.status = response.status_code
    return StreamingResponse(legs.relay(response, times), status_code=response.status_code,
                             media_type=response.headers.get("content-type"), headers={"X-Request-Id": rid})


def create_app(config: ProxyConfig, *, stats: StatsLog | None = None) -> FastAPI:
    """The proxy as an ASGI app (serve it with uvicorn; its lifespan opens the legs' clients).
    ``stats``: where request records go (default: a ring of ``config.stats_ring`` and
    ``config.stats_path``); also ``app.state.stats``."""
    legs = _Legs(config, stats or StatsLog(config.stats_ring, config.stats_path))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with legs.open():
            yield

    app = FastAPI(title="Lynx disaggregated prefill proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.stats = legs.stats
    app.state.config = config

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(legs, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _forward(legs, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            response = await legs.get("decode", "/v1/models")
        except LegError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        async def probe(leg: str) -> int | str:
            try:
                return (await legs.get(leg, "/health")).status_code
            except LegError as exc:
                return str(exc)

        prefill, decode = await asyncio.gather(probe("prefill"), probe("decode"))
        ok = prefill == 200 and decode == 200
        return JSONResponse({"status": "ok" if ok else "unavailable", "prefill": prefill, "decode": decode},
                            status_code=200 if ok else 503)

    @app.get("/lynx/requests")
    async def requests() -> Response:
        return JSONResponse(legs.stats.records())

    return app
