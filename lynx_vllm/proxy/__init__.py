"""An OpenAI-compatible front for a LynxConnector producer and consumer: vLLM's disaggregated
prefill as a client sees one server.

    python -m lynx_vllm.proxy --prefill 10.0.0.2:8100 --decode 10.0.0.3:8200 --port 8000

Each ``/v1/completions`` or ``/v1/chat/completions`` request runs twice: a one-token prefill on the
producer, which holds the prompt's cache and answers where it is (``kv_transfer_params``), then the
real request on the consumer, which pulls that cache over Lynx and decodes; the consumer's answer
(streamed or not) is the client's. The convention is vLLM's own (its example proxies); FastAPI,
uvicorn and httpx, which vLLM's environment has (``pip install 'lynx-kv[proxy]'`` elsewhere).

Reading order: :mod:`~lynx_vllm.proxy.legs` (the settings and what each leg is sent, pure),
:mod:`~lynx_vllm.proxy.stats` (per-request timestamps), :mod:`~lynx_vllm.proxy.app` (the HTTP
side, the only module that imports FastAPI and httpx, imported by :func:`create_app`),
:mod:`~lynx_vllm.proxy.__main__` (the command line: logging, uvicorn). Importing this package
imports none of FastAPI, uvicorn, httpx or vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lynx_vllm.proxy.legs import Codec, ProxyConfig, Upstream
from lynx_vllm.proxy.stats import RequestTimes, StatsLog

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["Codec", "ProxyConfig", "Upstream", "RequestTimes", "StatsLog", "INSTALL_HINT", "create_app"]

#: What to install when FastAPI, uvicorn or httpx are missing.
INSTALL_HINT = ("the proxy needs FastAPI, uvicorn and httpx: run it from the vLLM environment "
                "(make vllm-env), or pip install 'lynx-kv[proxy]'")


def create_app(config: ProxyConfig, **kwargs: Any) -> FastAPI:
    """The proxy's ASGI app (:func:`lynx_vllm.proxy.app.create_app`); imports FastAPI and httpx."""
    from lynx_vllm.proxy.app import create_app as create  # noqa: PLC0415 - FastAPI/httpx only when used

    return create(config, **kwargs)
