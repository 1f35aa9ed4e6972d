"""``lynx load``'s pure logic: the configuration, the bytes of a request, the
request rate an offered load means, LYNX's split, and the seeded open-loop
Poisson arrivals and prompts. What the runs measured (rows, summaries) is
:mod:`lynx_bench.load.results`; ``load.json`` and the tables are
:mod:`lynx_bench.load.report`.

No sockets, no processes, no clock: :mod:`lynx_bench.load.cli` runs the nodes,
so everything here is unit-tested (``tests/unit/test_load.py``).

Offered load is a fraction of the link: ``load = rate * bytes_int8 * 8 /
bandwidth``, with ``bytes_int8`` the bytes of one request's INT8 KV stream
(every region: the prompt's token ids and each layer's INT8 buffer), so every
scheme at one load sees the same request rate; a scheme that sends fewer bytes
(INT4, LYNX's anchors) uses less of the link at that rate.

Arrivals: one seeded sequence of unit-mean exponential gaps, scaled by
``1 / rate``: the same schedule (request ``i``'s decode node, prompt and
arrival) for every scheme at a load, and the same shape stretched at every
load (common random numbers, so p99-against-load curves are not noise between
loads). Requests go to the decode nodes in turn (request ``i`` to node
``i % K``), and pick one of the ``P`` prompts at random (seeded).

LYNX's split (``--planes``, default ``auto``): with the sink, ``auto`` is one
choice per run (:func:`lynx_split`; every request is the same size), possibly
no split, and then the LYNX phases run as INT8 (:func:`job_split`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lynx_bench.sweep.config import DEFAULT_PLANES, SCHEMES, LinkMode, check_writable_dir, parse_planes_flag
from lynx_decode.codec.config import ANCHOR_BITS, MAX_BITS, MIN_BITS, CodecConfig, Scheme
from lynx_decode.codec.layout import LayerLayout
from lynx_decode.split_choice import DEFAULT_STEP_S, SplitChoice, choose_split
from lynx_decode.timeouts import Timeouts
from lynx_transport.errors import ConfigError

__all__ = [
    "DecodeMode", "LoadConfig", "ModelShape", "lynx_split", "split_label", "job_split",
    "request_bytes", "rate_for_load", "load_for_rate", "Arrival", "poisson_arrivals", "prompt_set",
]


class DecodeMode(enum.Enum):
    """What the decode nodes do with a stream."""

    SINK = "sink"    #: receive into the pool, record when the anchors and the whole cache landed
    MODEL = "model"  #: decode it with the real model (DecodeNode.run)



# -- configuration -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """What ``lynx load`` runs; checked by :meth:`validate` before any process starts.

    Exactly one of ``loads`` (fractions of the link) and ``rates_rps`` (requests/s)
    is given. ``timeouts``: the nodes' timeouts; ``timeouts.stream_s`` (``--stream-timeout``)
    also bounds each request: one not finished that long after it was sent
    counts as ``timeout``. ``max_pending``: the prefill node's admission bound
    (``lynx serve --max-pending``; ``None``: its default). The LYNX split is
    :attr:`split`: ``anchor_bits`` when given, else ``planes``.
    """

    schemes: tuple[str, ...] = SCHEMES
    loads: tuple[float, ...] | None = (0.5, 0.8, 0.95)
    rates_rps: tuple[float, ...] | None = None
    requests: int = 200
    decode_nodes: int = 3
    context: int = 4096
    bandwidth_gbps: float = 1.0
    link: LinkMode = LinkMode.SHAPER
    decode: DecodeMode = DecodeMode.SINK
    prompts: int = 3
    #: the LYNX split (``--planes``): widths from the top bit down, or ``"auto"``: chosen for the
    #: link and a request's size (sink: once per run, :func:`lynx_split`; model: by each decode
    #: node per request, ``DecodeNode.run(planes="auto")``), possibly none: LYNX then runs as INT8
    planes: tuple[int, ...] | Literal["auto"] = "auto"
    #: ``--anchor-bits B``: the split ``B,8-B`` instead of ``planes`` (None: ``planes``)
    anchor_bits: int | None = None
    new_tokens: int = 32
    max_pending: int | None = None
    #: the prefill node's within-lane policy (``lynx serve --lane-policy``; None: its default)
    lane_policy: str | None = None
    #: sink decode nodes ask for each LYNX residual with its anchors, as a decode node does by
    #: default (``DecodeNode.run(hold_residual=False)``); True: held, and released the moment
    #: every anchor is in (a first step that takes no time)
    hold_residual: bool = False
    seed: int = 0
    out: Path = Path("load-out")
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)

    @property
    def request_timeout_s(self) -> float:
        return float(self.timeouts.stream_s)

    @property
    def split(self) -> tuple[int, ...] | Literal["auto"]:
        """The LYNX split asked for: ``(anchor_bits, 8 - anchor_bits)`` when
        ``anchor_bits`` is given, else ``planes`` (a tuple or ``"auto"``)."""
        if self.anchor_bits is not None:
            return (self.anchor_bits, 8 - self.anchor_bits)
        return self.planes if self.planes == "auto" else tuple(self.planes)

    def validate(self, max_context: int | None = None) -> LoadConfig:
        """Raise :class:`ConfigError` naming the first bad field; returns self."""
        if not self.schemes:
            raise ConfigError("--schemes: give at least one scheme")
        for scheme in self.schemes:
            if scheme not in SCHEMES:
                raise ConfigError(f"--schemes: unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
        if len(set(self.schemes)) != len(self.schemes):
            raise ConfigError("--schemes: a scheme is listed twice")
        if (self.loads is None) == (self.rates_rps is None):
            raise ConfigError("give either --load or --rate, not both")
        flag, values = ("--load", self.loads) if self.loads is not None else ("--rate", self.rates_rps)
        assert values is not None
        if not values:
            raise ConfigError(f"{flag}: give at least one value")
        for v in values:
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{flag}: {v:g} is not a positive finite number")
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ConfigError(f"--bandwidth: {self.bandwidth_gbps:g} Gbit/s is not a positive finite rate")
        for name, value, low in (("--requests", self.requests, 1), ("--decode-nodes", self.decode_nodes, 1),
                                 ("--prompts", self.prompts, 1), ("--new-tokens", self.new_tokens, 1)):
            if value < low:
                raise ConfigError(f"{name}: must be at least {low}, got {value}")
        if self.decode_nodes > 64:
            raise ConfigError(f"--decode-nodes: at most 64, got {self.decode_nodes}")
        if self.max_pending is not None and self.max_pending < 1:
            raise ConfigError(f"--max-pending: must be at least 1, got {self.max_pending}")
        if self.context < 64:
            raise ConfigError(f"--context: {self.context} tokens is too short (minimum 64)")
        if max_context is not None and self.context + self.new_tokens > max_context:
            raise ConfigError(f"--context: {self.context} + {self.new_tokens} new tokens exceeds the "
                              f"model's context window of {max_context} tokens")
        if self.anchor_bits is not None:
            if self.planes != "auto":
                raise ConfigError("give --planes or --anchor-bits, not both")
            if self.anchor_bits not in ANCHOR_BITS:
                raise ConfigError(f"--anchor-bits: must be in {MIN_BITS}..{MAX_BITS}, got {self.anchor_bits}")
        elif isinstance(self.planes, str):
            if self.planes != "auto":
                raise ConfigError(f"--planes: expected plane widths like 4,4 or 2,2,4, or auto; got {self.planes!r}")
        else:
            parse_planes_flag([",".join(str(w) for w in self.planes)], "--planes")
        check_writable_dir(self.out, "--out")
        return self

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["link"], d["decode"], d["out"] = self.link.value, self.decode.value, str(self.out)
        return d


# -- bytes and rates ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the byte count of a request depends on (read from the model's GGUF header)."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int


def request_bytes(shape: ModelShape, scheme: str, prompt_tokens: int,
                  planes: tuple[int, ...] = DEFAULT_PLANES) -> tuple[int, int]:
    """``(anchor_lane_bytes, residual_lane_bytes)`` of the KV stream the prefill node
    sends for a prompt of ``prompt_tokens`` tokens (it caches ``prompt_tokens - 1``
    positions and sends all the ids as int32 on the anchor lane; see
    :mod:`lynx_decode.kvheader`), encoded as the prefill node encodes ``scheme``
    (LYNX with the split ``planes``; the residual: every lane after the anchor's)."""
    s = Scheme(scheme)
    codec = CodecConfig(scheme=s, planes=tuple(planes)) if s is Scheme.LYNX else CodecConfig(scheme=s)
    layer = LayerLayout.build(codec, shape.kv_heads, prompt_tokens - 1, shape.head_dim)
    anchor = 4 * prompt_tokens + shape.layers * layer.plane_size(0)
    return anchor, shape.layers * sum(layer.plane_size(p) for p in range(1, layer.num_planes))


# -- the LYNX split -------------------------------------------------------------------------------

def lynx_split(config: LoadConfig, int8_bytes: int) -> SplitChoice:
    """The split a sink run's LYNX requests ask for (``.planes``; None: no split, the
    LYNX phases run as INT8): :attr:`LoadConfig.split` when fixed; with ``"auto"``
    :func:`~lynx_decode.split_choice.choose_split` for one request's ``int8_bytes`` on
    ``bandwidth_gbps`` at :data:`~lynx_decode.split_choice.DEFAULT_STEP_S` (a sink runs
    no model, so no step is measured). Every request of a run is the same size: one
    choice per run, its ``reason`` recorded in ``load.json``."""
    split = config.split
    if split != "auto":
        return SplitChoice(split)
    return choose_split(int8_bytes, config.bandwidth_gbps, DEFAULT_STEP_S)


def split_label(planes: Sequence[int] | None) -> str:
    """``(4, 4)`` -> ``"4,4"``; None (no split) -> ``"int8"``."""
    return "int8" if planes is None else ",".join(str(w) for w in planes)


def job_split(job: dict[str, Any]) -> tuple[Scheme, tuple[int, ...] | Literal["auto"]]:
    """The scheme and the split a decode node asks for to run ``job`` (its ``scheme``
    and ``planes``: a list of widths, ``"auto"``, the decode node chooses, or None).
    A LYNX job with no split runs as INT8 (auto chose none; its row keeps the phase's
    scheme); a job of another scheme carries its ``planes`` or the default split,
    which only LYNX reads."""
    scheme, planes = Scheme(job["scheme"]), job.get("planes")
    if planes == "auto":
        return scheme, "auto"
    if planes is None:
        return (Scheme.INT8 if scheme is Scheme.LYNX else scheme), DEFAULT_PLANES
    return scheme, tuple(int(w) for w in planes)


def rate_for_load(load: float, bandwidth_gbps: float, bytes_per_request: int) -> float:
    """Requests per second that offer ``load`` of a ``bandwidth_gbps`` link when each
    request is ``bytes_per_request`` bytes."""
    return load * bandwidth_gbps * 1e9 / (8.0 * bytes_per_request)


def load_for_rate(rate_rps: float, bandwidth_gbps: float, bytes_per_request: int) -> float:
    """The inverse of :func:`rate_for_load`."""
    return rate_rps * 8.0 * bytes_per_request / (bandwidth_gbps * 1e9)


# -- arrivals and prompts -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arrival:
    """Request ``index`` of a phase: sent ``arrival_s`` after the phase's start by
    decode node ``decode_node``, asking for prompt ``prompt_id``."""

    index: int
    arrival_s: float
    decode_node: int
    prompt_id: int


def poisson_arrivals(rate_rps: float, n: int, seed: int, *, decode_nodes: int = 1,
                     prompts: int = 1) -> tuple[Arrival, ...]:
    """``n`` open-loop Poisson arrivals at ``rate_rps`` (exponential gaps of mean
    ``1 / rate_rps``; the first request also waits one gap). The gaps and the
    prompt choices depend only on ``seed`` and ``n``, never on the rate: the
    schedules of two rates are the same shape, stretched."""
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ConfigError(f"the request rate must be a positive finite number, got {rate_rps!r}")
    if n < 0 or decode_nodes < 1 or prompts < 1:
        raise ConfigError("need n >= 0, decode_nodes >= 1 and prompts >= 1")
    rng = np.random.default_rng([seed, 0x10AD])
    gaps = rng.standard_exponential(n)
    choice = rng.integers(0, prompts, size=n)
    times = np.cumsum(gaps) / rate_rps
    return tuple(Arrival(i, float(times[i]), i % decode_nodes, int(choice[i])) for i in range(n))


def prompt_set(seed: int, prompts: int, context: int, vocab: int) -> list[list[int]]:
    """``prompts`` prompts of ``context`` seeded random token ids in ``[0, vocab)``:
    the fixed prompt set every request picks from (its prefills are cached)."""
    rng = np.random.default_rng([seed, 0x1D5])
    return [[int(t) for t in rng.integers(0, vocab, size=context)] for _ in range(prompts)]
