"""The proxy's pure parts: its settings, what each leg is sent, and what the client is told when a
leg fails. No I/O here: :mod:`lynx_vllm.proxy.app` does the HTTP.

vLLM's disaggregated-serving convention (its example proxies and NIXL's toy proxy):

- the **prefill leg** gets the client's body with ``max_tokens = 1`` (and ``max_completion_tokens = 1``
  where the client set it), ``stream = false``, no ``stream_options``, no ``min_tokens`` /
  ``min_completion_tokens`` (they cannot hold with one token) and ``kv_transfer_params =
  {"do_remote_decode": true, "do_remote_prefill": false}``: the producer computes the prompt, holds
  its cache and answers with the ``kv_transfer_params`` a consumer needs to pull it;
- the **decode leg** gets the client's body unchanged but for ``kv_transfer_params``: the prefill
  answer's, as they came, except that the proxy may set Lynx's ``scheme`` / ``planes`` inside
  ``kv_transfer_params["lynx"]`` (what :meth:`lynx_vllm.config.ConnectorConfig.request_codec`
  reads). A client picks them per request by sending ``kv_transfer_params: {"lynx": {"scheme":
  ..., "planes": ...}}`` itself (nothing else of a client's ``kv_transfer_params`` travels); the
  proxy's ``--scheme`` / ``--planes`` are the default; without either, the consumer's own
  ``kv_connector_extra_config`` decides.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from lynx_decode.codec.config import Scheme
from lynx_vllm.config import Planes, planes_of, scheme_of
from lynx_vllm.errors import ConnectorError, LegError
from lynx_vllm.plan import REMOTE_DECODE

__all__ = ["Upstream", "ProxyConfig", "Codec", "client_codec", "prefill_body", "decode_body", "error_excerpt",
           "leg_status_error"]

#: Client settings that cannot hold for a one-token prefill (vLLM refuses min_tokens > max_tokens).
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
#: How much of an upstream's error body goes into the client's message.
EXCERPT_CHARS = 300


@dataclasses.dataclass(frozen=True)
class Upstream:
    """One vLLM OpenAI server: ``HOST:PORT`` (or ``http://HOST:PORT``)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Upstream:
        """``"10.0.0.2:8100"`` or ``"http://10.0.0.2:8100"`` (``[::1]:8100`` for IPv6);
        :class:`ConnectorError` if it is neither."""
        rest = text.strip().removeprefix("http://").rstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
            raise ConnectorError(f"an upstream is HOST:PORT (e.g. 127.0.0.1:8100), got {text!r}")
        return cls(host.removeprefix("[").removesuffix("]"), int(port))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Codec:
    """Lynx's codec choice for a decode leg: either may be None (the consumer's default then)."""

    scheme: Scheme | None = None
    planes: Planes | None = None

    def __post_init__(self) -> None:
        if self.planes is not None and self.scheme not in (None, Scheme.LYNX):
            raise ConnectorError(f"planes only apply to the lynx scheme, not {self.scheme.value}")

    def over(self, default: Codec) -> Codec:
        """This choice where made, ``default``'s elsewhere, key by key (planes dropped for a scheme
        other than lynx: they only cut lynx codes)."""
        scheme = self.scheme if self.scheme is not None else default.scheme
        planes = self.planes if self.planes is not None else default.planes
        return Codec(scheme, planes if scheme in (None, Scheme.LYNX) else None)

    def params(self) -> dict[str, Any]:
        """The keys this choice puts into ``kv_transfer_params["lynx"]``."""
        out: dict[str, Any] = {}
        if self.scheme is not None:
            out["scheme"] = self.scheme.value
        if self.planes is not None:
            out["planes"] = self.planes if self.planes == "auto" else list(self.planes)
        return out


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """The proxy's settings (``python -m lynx_vllm.proxy --help``).

    ``timeout_s`` bounds every wait of a leg: the connect, the prefill leg's whole answer, the decode
    leg's response headers and then each wait for the next bytes of its body (a long stream is not
    cut, a stalled one is). ``stats_ring``: how many requests' timestamps ``GET /lynx/requests``
    keeps; ``stats_path``: a JSON-lines file that gets every request's record too.
    """

    prefill: Upstream
    decode: Upstream
    codec: Codec = Codec()
    timeout_s: float = 300.0
    stats_ring: int = 1024
    stats_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ConnectorError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        if self.stats_ring < 1:
            raise ConnectorError(f"stats_ring must be >= 1, got {self.stats_ring!r}")


def client_codec(body: Mapping[str, Any]) -> Codec:
    """The codec a client asked for in its body (``kv_transfer_params["lynx"]`` ``scheme`` /
    ``planes``); :class:`ConnectorError` if they are not valid."""
    params = body.get("kv_transfer_params")
    lynx = params.get("lynx") if isinstance(params, Mapping) else None
    if not isinstance(lynx, Mapping):
        return Codec()
    scheme = scheme_of(lynx["scheme"]) if lynx.get("scheme") is not None else None
    planes = planes_of(lynx["planes"]) if lynx.get("planes") is not None else None
    return Codec(scheme, planes)


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body (see the module docstring); ``body`` is not changed."""
    out = {k: copy.deepcopy(v) for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(REMOTE_DECODE)
    return out


def decode_body(body: Mapping[str, Any], prefill_params: Mapping[str, Any] | None, codec: Codec) -> dict[str, Any]:
    """The decode leg's body: ``body`` with the prefill answer's ``kv_transfer_params`` (none: the
    consumer computes the prompt itself), ``codec``'s keys set inside their ``"lynx"`` entry."""
    out = {k: copy.deepcopy(v) for k, v in body.items() if k != "kv_transfer_params"}
    if prefill_params:
        params = copy.deepcopy(dict(prefill_params))
        lynx = params.get("lynx")
        if isinstance(lynx, dict):
            lynx.update(codec.params())
        out["kv_transfer_params"] = params
    return out


def error_excerpt(text: str) -> str:
    """The reason in an upstream's error body: the ``message`` of an OpenAI/vLLM error JSON, FastAPI's
    ``detail``, or the start of the text."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    message: Any = None
    if isinstance(data, Mapping):
        error = data.get("error")
        message = error.get("message") if isinstance(error, Mapping) else error
        message = message or data.get("message") or data.get("detail")
    text = str(message) if message else text.strip()
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."


def leg_status_error(leg: str, status: int, reason: str, text: str) -> LegError:
    """The error for a leg whose server answered ``status``: its own 4xx for the client's mistakes
    (a bad request stays a bad request), 502 for anything else."""
    client_status = status if 400 <= status < 500 else 502
    kind = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
    return LegError(leg, client_status, kind, f"{status} {reason}: {error_excerpt(text) or '(no body)'}")
