"""What a ``make vllm-bench`` run's records say (:mod:`lynx_bench.vllm.bench`): the proxy's one record
per request (``proxy-requests.jsonl``: its legs' wall-clock times) matched with the consumer's load
records (LynxConnector's ``stats_path``: the pull, the header, each lane, the last layer), and the
percentiles taken of them: the consumer-side TTFT, where each TTFT goes, what ran beside each
decode, and the rate each load crossed the link at (a shaped run whose loads beat the link was not
shaped). Pure: records in, numbers out; no I/O, no vLLM imports."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from lynx_bench.common.stats import percentile

__all__ = ["median_p99", "consumer_ttfts", "ttft_breakdown", "wire_gbps", "pulled", "decode_overlaps",
           "SHAPING_SLACK", "shaping_error"]


def consumer_ttfts(proxy_records: Iterable[Mapping[str, Any]], prefix: str) -> list[float]:
    """Each request's decode-leg TTFT in ms (proxy ``decode_sent_at`` to ``decode_first_byte_at``),
    of the requests whose id starts with ``prefix`` and that succeeded."""
    out = []
    for r in proxy_records:
        if not str(r.get("request_id", "")).startswith(prefix) or r.get("error") is not None:
            continue
        sent, first = r.get("decode_sent_at"), r.get("decode_first_byte_at")
        if sent is not None and first is not None:
            out.append((first - sent) * 1000)
    return out


def median_p99(values: Sequence[float]) -> dict[str, float | None]:
    return {"median": percentile(values, 50), "p99": percentile(values, 99)}


def _load_of(proxied: Mapping[str, Any], loads: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The consumer's load of a proxied request: vLLM's request id carries the client's
    ``X-Request-Id`` inside one of its own (``cmpl-<id>-0-<hash>``), so another id may contain it
    too (``warmup-<id>``); of the loads whose id contains it, the first pulled after the decode leg
    was sent."""
    own = re.compile(re.escape(str(proxied.get("request_id", ""))) + r"(?!\d)")
    sent = proxied.get("decode_sent_at")
    found = [rec for rec in loads if own.search(str(rec.get("request_id", "")))]
    if sent is not None:
        found = sorted((rec for rec in found if rec["requested_at"] >= sent), key=lambda rec: rec["requested_at"])
    return found[0] if found else None


def _proxied_loads(proxy_records: Iterable[Mapping[str, Any]], loads: Iterable[Mapping[str, Any]],
                   prefix: str) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any] | None]]:
    """A run's requests that the proxy answered (their ids start with ``prefix``), each with its
    consumer load (:func:`_load_of`), or None when there is none or it failed."""
    loads = [rec for rec in loads if rec.get("requested_at") is not None]
    for r in proxy_records:
        if not str(r.get("request_id", "")).startswith(prefix) or r.get("error") is not None:
            continue
        load = _load_of(r, loads)
        yield r, (load if load is not None and load.get("error") is None else None)


def ttft_breakdown(proxy_records: Iterable[Mapping[str, Any]], loads: Iterable[Mapping[str, Any]],
                   prefix: str) -> dict[str, dict[str, float | None]]:
    """Where each request's TTFT goes, medians and p99 in ms: ``prefill`` (the proxy's prefill leg,
    the producer's prefill), ``handoff`` (prefill answer to decode leg sent), ``to_pull`` (decode leg
    sent to the consumer's pull request: its scheduling), ``transfer`` (pull request to the last
    layer landed), ``first_step`` (last layer landed to the decode leg's first bytes), and
    ``consumer_ttft`` (decode leg sent to its first bytes). ``loads``: the consumer's ``stats_path``
    records (LynxConnector); the pull's parts are absent without them."""
    parts: dict[str, list[float]] = {k: [] for k in ("prefill", "handoff", "to_pull", "transfer", "first_step",
                                                     "consumer_ttft")}

    def add(key: str, start: Any, end: Any) -> None:
        if start is not None and end is not None:
            parts[key].append((end - start) * 1000)

    for r, load in _proxied_loads(proxy_records, loads, prefix):
        add("prefill", r.get("prefill_sent_at"), r.get("prefill_answered_at"))
        add("handoff", r.get("prefill_answered_at"), r.get("decode_sent_at"))
        add("consumer_ttft", r.get("decode_sent_at"), r.get("decode_first_byte_at"))
        if load is not None:
            add("to_pull", r.get("decode_sent_at"), load.get("requested_at"))
            add("transfer", load.get("requested_at"), load.get("last_layer_landed_at"))
            add("first_step", load.get("last_layer_landed_at"), r.get("decode_first_byte_at"))
    return {k: {**median_p99(v), "n": float(len(v))} for k, v in parts.items()}


def wire_gbps(proxy_records: Iterable[Mapping[str, Any]], loads: Iterable[Mapping[str, Any]],
              prefix: str) -> list[float]:
    """The rate each of a run's loads crossed the link at, in Gbit/s: its ``bytes_on_wire`` over the
    time from its header to its last layer landed (the consumer's records, matched as in
    :func:`ttft_breakdown`); loads that failed or carry no times are left out."""
    out = []
    for _, load in _proxied_loads(proxy_records, loads, prefix):
        if load is None:
            continue
        start, end, nbytes = load.get("header_at"), load.get("last_layer_landed_at"), load.get("bytes_on_wire")
        if start is not None and end is not None and nbytes and end > start:
            out.append(nbytes * 8 / (end - start) / 1e9)
    return out


def pulled(proxy_records: Iterable[Mapping[str, Any]], loads: Iterable[Mapping[str, Any]],
           prefix: str) -> list[str] | None:
    """What a run's loads pulled, each distinct form once in order of first pull (``int8``,
    ``lynx 4,4``: the consumer's records, matched as in :func:`ttft_breakdown`), None without any
    load: a ``lynx`` configuration may pull INT8 (``auto`` in vLLM, see ``lynx_vllm.config``)."""
    forms = [load["scheme"] + ("" if not load.get("planes") else " " + ",".join(map(str, load["planes"])))
             for _, load in _proxied_loads(proxy_records, loads, prefix) if load is not None and load.get("scheme")]
    return list(dict.fromkeys(forms)) or None


def decode_overlaps(proxy_records: Iterable[Mapping[str, Any]], loads: Iterable[Mapping[str, Any]],
                    prefix: str) -> dict[str, int]:
    """What ran beside each request's decode (its decode leg's first bytes to its end, the proxy's
    wall clock): ``decodes`` counted, ``beside_a_load`` of them overlapped by another request's
    transfer (its pull request to its last layer landed, the consumer's records), ``beside_a_prefill``
    by another request's prefill leg (the producer prefilling, or its queue). A TPOT that grew under
    load grew from one or the other; an asynchronous load can only help the first."""
    pairs = list(_proxied_loads(proxy_records, loads, prefix))
    transfers = [(r.get("request_id"), load.get("requested_at"), load.get("last_layer_landed_at"))
                 for r, load in pairs if load is not None]
    prefills = [(r.get("request_id"), r.get("prefill_sent_at"), r.get("prefill_answered_at")) for r, _ in pairs]

    def beside(rid: Any, a: float, b: float, spans: list[tuple[Any, Any, Any]]) -> bool:
        return any(other != rid and s is not None and e is not None and s < b and e > a for other, s, e in spans)

    out = {"decodes": 0, "beside_a_load": 0, "beside_a_prefill": 0}
    for r, _ in pairs:
        a, b = r.get("decode_first_byte_at"), r.get("done_at")
        if a is None or b is None:
            continue
        rid = r.get("request_id")
        out["decodes"] += 1
        out["beside_a_load"] += beside(rid, a, b, transfers)
        out["beside_a_prefill"] += beside(rid, a, b, prefills)
    return out


#: A shaped run whose loads' median rate beats its link by more than this factor did not cross it.
SHAPING_SLACK = 1.1


def shaping_error(link_gbps: float | None, rates: Sequence[float]) -> str | None:
    """Why a run's rows cannot be read as shaped (its loads' median rate over ``link_gbps`` x
    :data:`SHAPING_SLACK`: the bytes took another path than the link), or None."""
    median = percentile(rates, 50)
    if link_gbps is None or median is None or median <= link_gbps * SHAPING_SLACK:
        return None
    return (f"its loads crossed at {median:.2f} Gbit/s (median of {len(rates)}), faster than the "
            f"{link_gbps:g} Gbit/s link: the bytes did not go through it")

