"""The connector's settings: vLLM's ``kv_connector_extra_config``, parsed once and validated.

Keys (all optional except ``port`` on a producer):

``host`` / ``port``
    Where the producer's Lynx listener takes pull requests (the consumer learns it
    from the request's ``kv_transfer_params``, so only the producer needs it; a
    fixed port, because vLLM's scheduler process must name it before the worker
    starts). On a consumer: where its receiver listens (default: any free port).
``scheme`` / ``planes``
    How the consumer asks for caches: ``bf16`` (lossless), ``int8``, ``int4`` or
    ``lynx`` (default; anchor + residual, exactly INT8 once both landed) with its
    plane split: ``"auto"`` (default) or widths such as ``"4,4"``. A vLLM consumer
    reads a layer only once every plane of it has landed (vLLM cannot decode on the
    anchors yet), so a split only reorders the bytes: layer 0 waits for its residual
    behind every layer's anchor, and the load pays a region per plane. Auto therefore
    pulls INT8, the same cache without the split, whatever the link (the load's record
    says so: ``scheme`` ``int8``, ``split_choice``); give widths to measure a split. A
    request's ``kv_transfer_params["lynx"]`` may override both.
``bandwidth_gbps``
    The producer's egress rate, every consumer together (Lynx's shaper; default
    unshaped).
``timeout_s`` / ``peer_timeout_s`` / ``connect_timeout_s``
    A load's end-to-end bound (header, every layer), the silence after which a
    peer counts as hung (default 30 s; a producer that died is noticed at once by
    its closed connection), and a connect's bound (:class:`~lynx_decode.timeouts.Timeouts`).
``max_prefills`` / ``hold_s``
    The producer holds the cache of each request sent with ``kv_transfer_params``
    ``{"do_remote_decode": true}`` for consumers to pull: at most ``max_prefills``
    (default 16; past it the least recently used is dropped), each until no consumer
    pulled it for ``hold_s`` seconds (default 60; a pull restarts the wait). Every
    drop is logged on ``lynx_vllm`` (a WARNING for a cache never pulled).
``load``
    How a consumer loads: ``"sync"`` (default) or ``"async"`` (:class:`LoadMode`).
    Sync: the forward pass that computes the request's last prompt token starts at
    once and waits inside each layer for that layer's cache (the transfer overlaps
    that forward layer by layer, but the whole batch waits with it). Async: vLLM
    parks the request (``WAITING_FOR_REMOTE_KVS``) while a Lynx thread pulls the
    cache and writes each layer into the request's blocks as it lands; the
    request is scheduled once all of it is in place, and the other requests keep
    decoding meanwhile. On vLLM's CPU backend an async consumer's worker must not
    be bound to a single CPU (``VLLM_CPU_OMP_THREADS_BIND=nobind``; see
    :mod:`lynx_vllm.load_threads`).
``ucx_tls`` / ``ucx_net_devices``
    The UCX transports and network devices of this instance's Lynx transport
    (``UCX_TLS`` / ``UCX_NET_DEVICES`` syntax; default: the transport's own, see
    :class:`~lynx_transport.config.TransportConfig`). The transport gives them to its
    UCX context, which wins over ``UCX_*`` variables in the environment: to keep the
    cache on one interface (an emulated or a chosen link), set ``"tcp"`` and the
    device here. Left alone, two instances on one host move it by ``cma``, past any
    qdisc on the link between them.
``stats_path``
    A JSON-lines file the consumer appends one record to per load (timestamps,
    bytes, outcome, ``load`` mode): what an operator or a test reads to see the overlap.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any, Literal

from lynx_decode.codec.config import CodecConfig, Scheme, check_planes, parse_planes
from lynx_decode.errors import CodecError
from lynx_decode.held_forms import held_as
from lynx_decode.timeouts import Timeouts
from lynx_transport.config import TransportConfig
from lynx_vllm.errors import ConnectorError

__all__ = ["ConnectorConfig", "LoadMode", "Planes", "codec_config", "scheme_of", "planes_of", "load_mode_of",
           "resolve_split", "prepared_forms", "NO_SPLIT_IN_VLLM"]

#: A LYNX split, or ``"auto"`` (:func:`resolve_split`: no split in vLLM).
Planes = tuple[int, ...] | Literal["auto"]

_KEYS = frozenset({"host", "port", "scheme", "planes", "bandwidth_gbps", "timeout_s", "peer_timeout_s",
                   "connect_timeout_s", "max_prefills", "hold_s", "stats_path", "load", "ucx_tls",
                   "ucx_net_devices"})


class LoadMode(enum.Enum):
    """How a consumer loads a request's cache (the ``load`` setting)."""

    #: inside the forward pass that computes the last prompt token, layer by layer (vLLM's synchronous load)
    SYNC = "sync"
    #: on a Lynx thread while vLLM schedules other requests; the request waits until its cache is in place
    ASYNC = "async"


def load_mode_of(value: Any) -> LoadMode:
    """The ``load`` setting (``"sync"`` or ``"async"``) as a :class:`LoadMode`; :class:`ConnectorError`
    naming the key and the allowed values for anything else."""
    try:
        return LoadMode(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in LoadMode)
        raise ConnectorError(f"load must be one of {allowed}; got {value!r}") from None


def codec_config(scheme: Scheme, planes: tuple[int, ...]) -> CodecConfig:
    """The codec configuration of ``scheme`` (``planes`` only matter for LYNX)."""
    return CodecConfig(scheme=scheme, planes=planes) if scheme is Scheme.LYNX else CodecConfig(scheme=scheme)


def scheme_of(value: Any) -> Scheme:
    """A scheme setting (``"bf16"``, ``"int8"``, ``"int4"``, ``"lynx"``, any case) as a :class:`Scheme`;
    :class:`ConnectorError` for anything else (fp16 included)."""
    try:
        scheme = Scheme(str(value).lower())
    except ValueError:
        raise ConnectorError(f"scheme must be one of bf16, int8, int4, lynx; got {value!r}") from None
    if scheme is Scheme.FP16:
        raise ConnectorError("scheme fp16 is not offered by the vLLM connector: use bf16 (lossless for vLLM's caches)")
    return scheme


def planes_of(value: Any) -> Planes:
    """A plane split (``"4,4"`` or a sequence of widths) as a validated tuple, or ``"auto"``;
    :class:`ConnectorError` if bad."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_planes(value) if isinstance(value, str) else check_planes(value)
    except CodecError as exc:
        raise ConnectorError(f"planes: {exc}") from None


def _ucx_setting(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConnectorError(f"{name} must be a non-empty string in UCX's syntax (e.g. \"tcp\"), got {value!r}")
    return value


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConnectorError(f"{name} must be a positive number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` says (see the module docstring)."""

    host: str = "127.0.0.1"
    port: int = 0
    scheme: Scheme = Scheme.LYNX
    planes: Planes = "auto"
    bandwidth_gbps: float | None = None
    timeout_s: float = 30.0
    peer_timeout_s: float = Timeouts.peer_s
    connect_timeout_s: float = 5.0
    max_prefills: int = 16
    hold_s: float = 60.0
    stats_path: str | None = None
    load: LoadMode = LoadMode.SYNC
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, *, producer: bool) -> ConnectorConfig:
        """Parse vLLM's ``kv_connector_extra_config``; :class:`ConnectorError` names any bad key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConnectorError(f"unknown LynxConnector settings {unknown}; known: {sorted(_KEYS)}")
        port = extra.get("port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ConnectorError(f"port must be an int in 0..65535, got {port!r}")
        if producer and port == 0:
            raise ConnectorError("a producer needs a fixed port in kv_connector_extra_config "
                                 "(consumers learn it from each request's kv_transfer_params)")
        max_prefills = extra.get("max_prefills", 16)
        if isinstance(max_prefills, bool) or not isinstance(max_prefills, int) or max_prefills < 1:
            raise ConnectorError(f"max_prefills must be an int >= 1, got {max_prefills!r}")
        rate = extra.get("bandwidth_gbps")
        return cls(
            host=str(extra.get("host", "127.0.0.1")),
            port=port,
            scheme=scheme_of(extra.get("scheme", "lynx")),
            planes=planes_of(extra.get("planes", "auto")),
            bandwidth_gbps=None if rate is None else _positive("bandwidth_gbps", rate),
            timeout_s=_positive("timeout_s", extra.get("timeout_s", 30.0)),
            peer_timeout_s=_positive("peer_timeout_s", extra.get("peer_timeout_s", Timeouts.peer_s)),
            connect_timeout_s=_positive("connect_timeout_s", extra.get("connect_timeout_s", 5.0)),
            max_prefills=max_prefills,
            hold_s=_positive("hold_s", extra.get("hold_s", 60.0)),
            stats_path=None if extra.get("stats_path") is None else str(extra["stats_path"]),
            load=load_mode_of(extra.get("load", LoadMode.SYNC.value)),
            ucx_tls=_ucx_setting("ucx_tls", extra.get("ucx_tls")),
            ucx_net_devices=_ucx_setting("ucx_net_devices", extra.get("ucx_net_devices")),
        )

    def timeouts(self) -> Timeouts:
        return Timeouts(connect_s=self.connect_timeout_s, peer_s=self.peer_timeout_s, stream_s=self.timeout_s)

    def transport_config(self) -> TransportConfig:
        """The Lynx transport's settings: its defaults, with ``ucx_tls`` / ``ucx_net_devices`` where set
        (the timeouts are applied by whoever holds :meth:`timeouts`)."""
        base = TransportConfig()
        return dataclasses.replace(base, ucx_tls=self.ucx_tls or base.ucx_tls,
                                   ucx_net_devices=self.ucx_net_devices or base.ucx_net_devices)

    def request_codec(self, params: Mapping[str, Any] | None) -> tuple[Scheme, Planes]:
        """The scheme and planes a load asks for: the request's ``kv_transfer_params["lynx"]``
        ``scheme``/``planes`` where given, else this config's."""
        lynx = (params or {}).get("lynx") or {}
        scheme = scheme_of(lynx["scheme"]) if "scheme" in lynx else self.scheme
        planes = planes_of(lynx["planes"]) if "planes" in lynx else self.planes
        return scheme, planes


#: Why ``auto`` pulls INT8 in vLLM (a load record's ``split_choice``).
NO_SPLIT_IN_VLLM = ("int8 (no split): a vLLM consumer reads a layer once all its planes landed, "
                    "so a split cannot bring the first token sooner")


def resolve_split(scheme: Scheme, planes: Planes) -> tuple[Scheme, tuple[int, ...], str | None]:
    """The scheme and split a load pulls, and why (None unless ``auto`` chose): ``auto`` with LYNX
    pulls INT8 (:data:`NO_SPLIT_IN_VLLM`; unlike Lynx's own decode node, which drafts on the
    anchors and so takes :func:`~lynx_decode.split_choice.choose_split`); a given split, or
    another scheme, is taken as it is."""
    if planes != "auto":
        return scheme, planes, None
    if scheme is not Scheme.LYNX:
        return scheme, (4, 4), None
    return Scheme.INT8, (4, 4), NO_SPLIT_IN_VLLM


def prepared_forms(scheme: Scheme, planes: Planes) -> tuple[CodecConfig, ...]:
    """The forms a producer encodes each saved layer into for consumers configured with
    ``scheme``/``planes``: the form such a consumer's pull is held in (:func:`resolve_split`, then
    :func:`~lynx_decode.held_forms.held_as`: INT8 for LYNX ``auto`` and for any split, whose
    planes the prefill node cuts from the INT8 codes as it sends them)."""
    pulled, split, _ = resolve_split(scheme, planes)
    return (held_as(codec_config(pulled, split)),)
