"""``lynx load``'s measured results: how a request ended (:class:`Status`), one row
per request (:class:`RequestRow`, from a decode node's ``RESULT`` line), percentiles,
the per-(scheme, load) summary (:class:`SummaryRow`) and a phase's peak egress.

Pure: no sockets, no processes, no clock; unit-tested in ``tests/unit/test_load.py``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lynx_bench.common.stats import percentile
from lynx_decode.codec.config import Scheme

__all__ = [
    "Status", "RequestRow", "REQUEST_FIELDS", "request_row", "SummaryRow", "SUMMARY_FIELDS",
    "summarize", "peak_egress_gbps", "send_record_summary",
]


class Status(enum.Enum):
    """How a request ended."""

    COMPLETED = "completed"  #: its whole cache landed (sink) / its tokens were decoded (model)
    BUSY = "busy"            #: the prefill node refused it: its queue was full ("busy" error reply)
    REFUSED = "refused"      #: another error reply from the prefill node
    FAILED = "failed"        #: the request or its stream failed (transport or decode error)
    TIMEOUT = "timeout"      #: not finished within the request timeout after it was sent

# -- requests -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RequestRow:
    """One request (``load.json``'s ``requests``); every time counts from the moment
    its decode node sent the request, on the shared wall clock. ``arrival_s``: when
    it was sent, from its phase's start. ``ttft_s``: until the decode node held
    everything its first token needs (sink: LYNX's anchor lane, other schemes the
    whole cache, and so is a LYNX request run as INT8; model: the first token);
    ``ttfct_s``: its first committed token
    (sink: the whole cache). ``time_to_anchor_s`` / ``time_to_full_s``: the anchor
    lane / every byte landed. ``e2e_s``: all tokens (model; ``None`` for sink)."""

    scheme: str
    load: float
    request_id: str
    decode_node: int
    arrival_s: float | None
    ttft_s: float | None
    ttfct_s: float | None
    time_to_anchor_s: float | None
    time_to_full_s: float | None
    e2e_s: float | None
    bytes_anchor: int | None
    bytes_residual: int | None
    status: str


REQUEST_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RequestRow))


def _since(t: Any, start: float) -> float | None:
    return None if t is None else float(t) - start


def request_row(scheme: str, load: float, decode_node: int, phase_start_unix: float,
                result: dict[str, Any]) -> RequestRow:
    """The row of one request from its decode node's report (``RESULT`` line):
    ``request_id``, ``status``, ``sent_unix`` and, as far as they happened,
    ``anchor_unix`` / ``full_unix`` (wall-clock times the anchor lane and the whole
    stream landed), ``bytes_anchor`` / ``bytes_residual``, ``scheme`` (the scheme it
    asked for, ``int8`` for a LYNX job with no split; default ``scheme``); for ``--decode model``
    instead ``ttft_s``, ``ttfct_s``, ``e2e_s``, ``time_to_anchor_s`` and
    ``time_to_full_s``, already counted from the request."""
    status = Status(result["status"])
    sent = result.get("sent_unix")
    if sent is None:  # never sent (the decode node was stopped first)
        return RequestRow(scheme, load, str(result["request_id"]), decode_node, None, None, None,
                          None, None, None, None, None, status.value)
    if "ttft_s" in result:  # the model decoded it: token and lane times, from the request
        ttft, ttfct, e2e = result.get("ttft_s"), result.get("ttfct_s"), result.get("e2e_s")
        anchor, full = result.get("time_to_anchor_s"), result.get("time_to_full_s")
    else:  # sink: what the first (committed) token would need
        anchor = _since(result.get("anchor_unix"), sent)
        full = _since(result.get("full_unix"), sent)
        ttft = anchor if result.get("scheme", scheme) == Scheme.LYNX.value else full
        ttfct, e2e = full, None
    return RequestRow(scheme, load, str(result["request_id"]), decode_node, float(sent) - phase_start_unix,
                      ttft, ttfct, anchor, full, e2e, result.get("bytes_anchor"),
                      result.get("bytes_residual"), status.value)


# -- summary ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One (scheme, load) phase (``load.json``'s ``summary``). Percentiles are over
    the completed requests only (a failed request has no full time, and often no
    first token); ``failed`` counts every request that did not complete.
    ``link_utilization``: bytes of the completed requests' streams, over what the
    link could carry from the phase's first request to its last completion."""

    scheme: str
    load: float
    requests: int
    completed: int
    failed: int
    p50_ttft_s: float | None
    p90_ttft_s: float | None
    p99_ttft_s: float | None
    p50_ttfct_s: float | None
    p99_ttfct_s: float | None
    p99_full_s: float | None
    link_utilization: float | None


SUMMARY_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SummaryRow))


def _utilization(rows: Sequence[RequestRow], bandwidth_gbps: float) -> float | None:
    done = [r for r in rows if r.status == Status.COMPLETED.value and r.arrival_s is not None
            and r.time_to_full_s is not None]
    starts = [r.arrival_s for r in rows if r.arrival_s is not None]
    if not done or not starts:
        return None
    span = max(r.arrival_s + r.time_to_full_s for r in done) - min(starts)  # type: ignore[operator]
    nbytes = sum((r.bytes_anchor or 0) + (r.bytes_residual or 0) for r in done)
    return nbytes * 8.0 / (bandwidth_gbps * 1e9 * span) if span > 0 else None


def peak_egress_gbps(rows: Sequence[RequestRow], min_bytes: int = 8 << 20) -> float | None:
    """A lower bound on the link's busiest average rate in a phase: over every window
    from one request's send to another's completion, the bytes of the completed
    requests sent and completed inside it, over its length (their bytes can only
    have moved in there); windows carrying less than ``min_bytes`` are skipped (a
    shaper's burst would dominate them). Above the link's rate means the link was
    not held to it, e.g. each peer shaped separately. ``None`` without such a window."""
    done = sorted((r.arrival_s, r.arrival_s + r.time_to_full_s, (r.bytes_anchor or 0) + (r.bytes_residual or 0))
                  for r in rows if r.status == Status.COMPLETED.value and r.arrival_s is not None
                  and r.time_to_full_s is not None and r.time_to_full_s > 0)
    best: float | None = None
    for i, (start, _, _) in enumerate(done):
        later = sorted((end, nbytes) for _, end, nbytes in done[i:])  # sent at or after `start`
        total = 0
        for end, nbytes in later:
            total += nbytes
            if end > start and total >= min_bytes:
                rate = total * 8.0 / ((end - start) * 1e9)
                best = rate if best is None else max(best, rate)
    return best


def summarize(rows: Sequence[RequestRow], bandwidth_gbps: float) -> list[SummaryRow]:
    """One :class:`SummaryRow` per (scheme, load), in the order the phases first appear."""
    groups: dict[tuple[str, float], list[RequestRow]] = {}
    for row in rows:
        groups.setdefault((row.scheme, row.load), []).append(row)
    out = []
    for (scheme, load), group in groups.items():
        done = [r for r in group if r.status == Status.COMPLETED.value]

        def pct(field: str, q: float, done: list[RequestRow] = done) -> float | None:
            return percentile((getattr(r, field) for r in done if getattr(r, field) is not None), q)

        out.append(SummaryRow(
            scheme=scheme, load=load, requests=len(group), completed=len(done),
            failed=len(group) - len(done),
            p50_ttft_s=pct("ttft_s", 50), p90_ttft_s=pct("ttft_s", 90), p99_ttft_s=pct("ttft_s", 99),
            p50_ttfct_s=pct("ttfct_s", 50), p99_ttfct_s=pct("ttfct_s", 99),
            p99_full_s=pct("time_to_full_s", 99),
            link_utilization=_utilization(group, bandwidth_gbps)))
    return out


def send_record_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The prefill node's send records (``lynx serve --records``; every request it
    sent, warm-up included) per scheme: how many, ``first_byte_s`` (its ``t0`` to the
    stream's first chunk handed to UCX) at p50/p99, and the bytes it held per prompt
    (median)."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        by.setdefault(str(r.get("scheme")), []).append(r)
    out = {}
    for scheme, rs in sorted(by.items()):
        first = [float(r["first_byte_s"]) for r in rs if r.get("first_byte_s") is not None]
        held = [float(r["held_bytes"]) for r in rs if r.get("held_bytes") is not None]
        out[scheme] = {"requests": len(rs), "first_byte_p50_s": percentile(first, 50),
                       "first_byte_p99_s": percentile(first, 99), "held_bytes_p50": percentile(held, 50)}
    return out
