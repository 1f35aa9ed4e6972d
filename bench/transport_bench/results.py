"""The result dictionary of ``lynx bench-transport`` from what its runs timed.

:func:`summarize` turns the rounds' merged :class:`~lynx_bench.transport_bench.runner.Record`
and Lynx's shaped runs (:class:`~lynx_bench.transport_bench.lynx_runs.LynxAfterRounds`)
into the JSON the command writes (fields as in :mod:`lynx_bench.transport_bench.cli`):
throughput medians in decimal Gbit/s, the peer engines' faster configurations, the
latency summaries, the ratios and the targets met or missed
(:mod:`lynx_bench.transport_bench.targets`; null when a peer was skipped).
"""

from __future__ import annotations

import statistics
from typing import Any

from lynx_bench.transport_bench.lynx_runs import ANCHOR_BYTES, LynxAfterRounds
from lynx_bench.transport_bench.peer_runs import MOONCAKE_TCP, NIXL, NIXL_TCP, best_of, latency_summary
from lynx_bench.transport_bench.peers.mooncake import CONFIG as MOONCAKE_CONFIG
from lynx_bench.transport_bench.runner import LATENCY_SIZES, Plan, Record
from lynx_bench.transport_bench.targets import targets_met
from lynx_transport import TransportConfig

__all__ = ["summarize"]

def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes * 8 / statistics.median(seconds) / 1e9 if seconds else float("nan")


def _lanes(stats: Any) -> list[dict[str, Any]]:
    return [{"lane": s.lane, "bytes": s.bytes, "chunks": s.chunks,
             "achieved_gbps": round(s.achieved_gbps, 3), "queued_bytes": s.queued_bytes,
             "inflight_bytes": s.inflight_bytes} for s in stats.lanes]


def _latency(latency_s: dict[str, dict[int, list[float]]]) -> dict[str, dict[str, Any]]:
    return {name: {str(size): latency_summary(v) for size, v in sizes.items()}
            for name, sizes in latency_s.items()}


def _perftest_latency(record: Record, plan: Plan) -> dict[str, dict[str, Any]]:
    """``ucx_perftest``'s latency entry: the median of its runs' own 50th percentiles; it
    reports no tail, so ``p99_us`` is null."""
    if not record.perftest_latency_us:
        return {}
    per_run = max(plan.latency_messages, 5)
    return {"ucx_perftest": {str(size): {"messages": per_run * len(runs),
                                         "median_us": round(statistics.median(runs), 1),
                                         "p99_us": None}
                             for size, runs in record.perftest_latency_us.items()}}


def _throughput(times: dict[str, list[float]], nbytes: int,
                perftest_gbps: list[float]) -> dict[str, Any]:
    """The throughput fields, ``lynx_gbps`` to ``mooncake_tcp_gbps``, in the JSON's order."""
    def median_of(name: str) -> float | None:
        return round(_median_gbps(nbytes, times[name]), 3) if times.get(name) else None

    def best(names: dict[str, Any], suffix: str = "") -> tuple[float | None, str | None]:
        return best_of({n: g for n in names if (g := median_of(n + suffix)) is not None}, names)

    nixl, nixl_config = best(NIXL)
    nixl_written, nixl_written_config = best(NIXL, "_written")
    nixl_tcp, nixl_tcp_config = best(NIXL_TCP)
    return {
        "lynx_gbps": round(_median_gbps(nbytes, times["lynx"]), 3),
        "ucxx_gbps": median_of("ucxx"),
        "ucx_perftest_gbps": round(statistics.median(perftest_gbps), 3),
        "lynx_written_gbps": median_of("lynx_written"),
        "ucxx_written_gbps": median_of("ucxx_written"),
        "asyncio_tcp_gbps": median_of("asyncio_tcp"),
        "lynx_tcp_gbps": median_of("lynx_tcp"),
        "nixl_gbps": nixl,
        "nixl_config": nixl_config,
        **{f"{n}_gbps": median_of(n) for n in NIXL},
        "nixl_written_gbps": nixl_written,
        "nixl_written_config": nixl_written_config,
        **{f"{n}_written_gbps": median_of(n + "_written") for n in NIXL},
        "nixl_tcp_gbps": nixl_tcp,
        "nixl_tcp_config": nixl_tcp_config,
        **{f"{n}_gbps": median_of(n) for n in NIXL_TCP},
        "mooncake_tcp_gbps": median_of(MOONCAKE_TCP),
    }


def _details(record: Record, after: LynxAfterRounds, plan: Plan, config: TransportConfig,
             link_gbps: float) -> dict[str, Any]:
    """The ``details`` field: the run's settings, timings' definitions and every raw value."""
    nbytes = plan.nbytes
    return {
        "message_bytes": nbytes, "messages_per_backend": len(record.throughput_s["lynx"]),
        "ucx_tls": plan.tls, "ucx_error_handling": "none (ucx_perftest without -e)",
        "send_buffers": "lynx_gbps, ucxx_gbps, lynx_tcp_gbps and the peer engines: allocated "
                        "and never written, like ucx_perftest's; *_written_gbps (NIXL's "
                        "too), asyncio_tcp_gbps: written",
        "chunk_bytes": config.chunk_bytes, "max_inflight_bytes": config.max_inflight_bytes,
        "rails": config.rails,
        "lynx_gbps_timing": "first chunk handed to UCX -> receiver's STREAM_DONE",
        "lynx_end_to_end_gbps": round(_median_gbps(nbytes, record.end_to_end_s), 3),
        "lynx_end_to_end_timing": "send_stream() -> receiver's STREAM_DONE (adds the "
                                  "manifest round trip and posting the receives)",
        "peer_timing": "the initiator's write call -> its completion (bytes in the target's "
                       "memory); NIXL: transfer() -> check_xfer_state() == DONE, "
                       "Mooncake: transfer_sync_write()",
        "peer_configs": {**{n: c.described for n, c in {**NIXL, **NIXL_TCP}.items()},
                         MOONCAKE_TCP: MOONCAKE_CONFIG},
        "latency_timing": "lynx_oneway, lynx_tcp_oneway: one stream of one region on the "
                          "anchor lane, the sender's send_stream() call -> the receiver's "
                          "on_region callback (time.monotonic() in both processes); "
                          "ucx_perftest: tag_lat's own 50th percentile of half a ping-pong "
                          "(no p99: it reports none); "
                          "nixl_notified: NIXL's polling configuration, each write with a "
                          "notification, the initiator's transfer() -> the target's "
                          "get_new_notifs() returning it (time.monotonic() in both); "
                          "lynx, lynx_tcp: the same streams, "
                          "send_stream() -> receiver's STREAM_DONE; peers: one write",
        "lynx_data_path_latency": _latency(record.data_latency_s),
        "lynx_data_path_latency_timing": "the same streams, first chunk handed to UCX -> "
                                         "receiver's STREAM_DONE (no manifest round trip)",
        "per_message_gbps": {k: [round(nbytes * 8 / t / 1e9, 3) for t in v]
                             for k, v in record.throughput_s.items()},
        "ucx_perftest_runs_gbps": [round(x, 3) for x in record.perftest_gbps],
        "ucx_perftest_tcp_runs_gbps": [round(x, 3) for x in record.perftest_tcp_gbps],
        "anchor_under_load_ratios": [round(x, 4) for x in after.anchor_ratios],
        "anchor_link_gbps": link_gbps, "anchor_bytes": ANCHOR_BYTES,
        "shaping": after.shaping["lynx"], "shaping_tcp": after.shaping["lynx_tcp"],
        "sender_lanes": _lanes(after.sender_stats), "receiver_lanes": _lanes(after.receiver_stats),
    }


def _add_ratios(result: dict[str, Any], lynx_gbps: float) -> None:
    """The ratios against the baselines and the peers (``lynx_gbps`` unrounded), then
    ``targets_met``."""
    lat = result["latency"]

    def p99_vs_best(name: str, others: list[str]) -> float | None:
        best = [lat[o][str(LATENCY_SIZES[0])]["p99_us"] for o in others if o in lat]
        return _ratio(lat[name][str(LATENCY_SIZES[0])]["p99_us"], min(best)) if best else None

    result["lynx_vs_ucx_perftest"] = round(lynx_gbps / result["ucx_perftest_gbps"], 3)
    result["lynx_vs_asyncio_tcp"] = _ratio(result["lynx_written_gbps"], result["asyncio_tcp_gbps"])
    result["lynx_vs_ucxx_written"] = _ratio(result["lynx_written_gbps"], result["ucxx_written_gbps"])
    result["lynx_vs_nixl"] = _ratio(result["lynx_gbps"], result["nixl_gbps"])
    result["lynx_written_vs_nixl_written"] = _ratio(result["lynx_written_gbps"],
                                                    result["nixl_written_gbps"])
    result["lynx_tcp_vs_nixl_tcp"] = _ratio(result["lynx_tcp_gbps"], result["nixl_tcp_gbps"])
    result["lynx_tcp_vs_mooncake_tcp"] = _ratio(result["lynx_tcp_gbps"], result["mooncake_tcp_gbps"])
    result["lynx_tcp_vs_ucx_perftest_tcp"] = _ratio(result["lynx_tcp_gbps"], result["ucx_perftest_tcp_gbps"])
    result["lynx_p99_64k_vs_best_peer"] = p99_vs_best("lynx", list(NIXL))
    result["lynx_tcp_p99_64k_vs_best_peer"] = p99_vs_best("lynx_tcp", [*NIXL_TCP, MOONCAKE_TCP])

    def median(name: str, size: int) -> float | None:
        return lat.get(name, {}).get(str(size), {}).get("median_us")

    small, big = LATENCY_SIZES
    result["lynx_oneway_64k_median_us"] = median("lynx_oneway", small)
    result["lynx_oneway_64k_p99_us"] = lat.get("lynx_oneway", {}).get(str(small), {}).get("p99_us")
    result["lynx_oneway_64k_vs_ucx_perftest"] = _ratio(median("lynx_oneway", small),
                                                       median("ucx_perftest", small))
    result["lynx_tcp_oneway_64k_vs_mooncake_tcp"] = _ratio(median("lynx_tcp_oneway", small),
                                                           median(MOONCAKE_TCP, small))
    result["lynx_oneway_1m_vs_nixl_polling"] = _ratio(median("lynx_oneway", big),
                                                      median("nixl_polling", big))
    result["targets_met"] = targets_met(result)


def summarize(record: Record, after: LynxAfterRounds, plan: Plan, config: TransportConfig,
              link_gbps: float, skipped: dict[str, str]) -> dict[str, Any]:
    """The result dictionary of a run of ``plan`` with Lynx's ``config``: ``record`` holds
    every round's timings, ``after`` the shaped runs over a ``link_gbps`` link, ``skipped``
    the peer engines that could not run (engine -> reason with the install hint)."""
    result = {
        **_throughput(record.throughput_s, plan.nbytes, record.perftest_gbps),
        "ucx_perftest_tcp_gbps": (round(statistics.median(record.perftest_tcp_gbps), 3)
                                  if record.perftest_tcp_gbps else None),
        "anchor_under_load_ratio": round(statistics.median(after.anchor_ratios), 4),
        "shaping_error": max(e["error"] for e in after.shaping["lynx"].values()),
        "shaping_error_tcp": max(e["error"] for e in after.shaping["lynx_tcp"].values()),
        "latency": {**_latency(record.latency_s), **_perftest_latency(record, plan)},
        "skipped": skipped,
        "details": _details(record, after, plan, config, link_gbps),
    }
    _add_ratios(result, _median_gbps(plan.nbytes, record.throughput_s["lynx"]))
    return result
