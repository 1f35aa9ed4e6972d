"""``lynx load``'s requests on running nodes: a decode node's job, the warm-up
(every prompt's prefill cached, every node and scheme exercised, the byte counts
checked against the model's shape) and one measured (scheme, load) phase on its
arrival schedule, with what the phase recorded for ``load.json``'s ``phases``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from lynx_bench.common.processes import ChildError
from lynx_bench.common.progress import Progress
from lynx_bench.load.launch import Nodes
from lynx_bench.load.logic import Arrival, LoadConfig, ModelShape, request_bytes, split_label
from lynx_bench.load.results import RequestRow, Status, peak_egress_gbps, request_row
from lynx_bench.sweep.config import DEFAULT_PLANES

__all__ = ["START_LEAD_S", "GRACE_S", "Planes", "job", "warm_up", "run_phase"]

#: A phase's schedule starts this long after it is handed out, so every decode node has it.
START_LEAD_S = 0.3
#: Beyond its last request's timeout, how long a phase may take before a node counts as hung.
GRACE_S = 30.0
#: What the LYNX requests ask for: a split, None (INT8: auto chose none) or "auto" (the decode node chooses).
Planes = tuple[int, ...] | Literal["auto"] | None


def job(rid: str, scheme: str, prompt: int, send_unix: float, config: LoadConfig,
        bandwidth: float | None, planes: Planes) -> dict[str, Any]:
    """One request for a decode node (:func:`lynx_bench.load.logic.job_split` reads its split)."""
    return {"request_id": rid, "scheme": scheme, "prompt_id": prompt, "send_unix": send_unix,
            "timeout_s": config.request_timeout_s,
            "planes": planes if planes is None or planes == "auto" else list(planes),
            "bandwidth_gbps": bandwidth, "new_tokens": config.new_tokens,
            "hold_residual": config.hold_residual}


def _one(nodes: Nodes, config: LoadConfig, rid: str, node: int, scheme: str, prompt: int,
         bandwidth: float | None, planes: Planes, bar: Progress | None = None) -> dict[str, Any]:
    """One request, alone (a warm-up: its time is not counted towards the bar's estimate)."""
    nodes.send(node, [job(rid, scheme, prompt, time.time(), config, bandwidth, planes)])
    return nodes.gather({rid}, time.monotonic() + config.request_timeout_s + GRACE_S, rid, bar,
                        timed=False)[rid]


def _ran(result: dict[str, Any], scheme: str) -> tuple[str, tuple[int, ...] | None]:
    """The scheme and the LYNX split (None: not LYNX) a decode node reports it ran."""
    ran = str(result.get("scheme") or scheme)
    planes = result.get("planes")
    return ran, (tuple(planes) if ran == "lynx" and planes else None)


def warm_up(nodes: Nodes, config: LoadConfig, shape: ModelShape, bandwidth: float | None, planes: Planes,
             bar: Progress) -> list[dict[str, Any]]:
    """Every prompt once as INT8 (its prefill is then cached), every decode node and
    every scheme at least once (connections made, code paths warm). Each INT8 and
    LYNX stream must carry the bytes the model's shape gives for what it ran."""
    plan = [(p % config.decode_nodes, "int8", p) for p in range(config.prompts)]
    plan += [(n, "int8", 0) for n in range(config.prompts, config.decode_nodes)]
    plan += [(i % config.decode_nodes, s, 0) for i, s in enumerate(config.schemes)]
    done = []
    for i, (node, scheme, prompt) in enumerate(plan):
        out = _one(nodes, config, f"warmup-{i}", node, scheme, prompt, bandwidth, planes, bar)
        if out["status"] != Status.COMPLETED.value:
            raise ChildError(f"warm-up request {i} ({scheme}, prompt {prompt}, decode node {node}) "
                             f"ended {out['status']}: {out.get('error')}")
        got = (out.get("bytes_anchor") or 0) + (out.get("bytes_residual") or 0)
        ran, split = _ran(out, scheme)
        if ran in ("int8", "lynx"):
            want = sum(request_bytes(shape, ran, config.context, split or DEFAULT_PLANES))
            if got != want:
                what = "INT8" if split is None else f"LYNX {split_label(split)}"
                raise ChildError(f"warm-up request {i}: its {what} stream carried {got} bytes; the model's "
                                 f"shape says {want}: the offered load and the byte counts would be wrong")
        done.append({"node": node, "scheme": scheme, "prompt_id": prompt, "status": out["status"],
                     "planes": split_label(split) if scheme == "lynx" else None})
    return done


def _planes_ran(results: dict[str, dict[str, Any]], scheme: str) -> dict[str, int] | None:
    """How many of a LYNX phase's completed requests ran each split (``"int8"``: no
    split); None for the other schemes."""
    if scheme != "lynx":
        return None
    counts: dict[str, int] = {}
    for r in results.values():
        if r["status"] == Status.COMPLETED.value:
            name = split_label(_ran(r, scheme)[1])
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def run_phase(nodes: Nodes, config: LoadConfig, number: int, scheme: str, load: float, rate: float,
           arrivals: tuple[Arrival, ...], bandwidth: float | None, planes: Planes,
           bar: Progress) -> tuple[list[RequestRow], dict[str, Any]]:
    t_zero = time.time() + START_LEAD_S
    per_node: dict[int, list[dict[str, Any]]] = {}
    node_of: dict[str, int] = {}
    for a in arrivals:
        rid = f"p{number}-{scheme}-{a.index}"
        node_of[rid] = a.decode_node
        per_node.setdefault(a.decode_node, []).append(
            job(rid, scheme, a.prompt_id, t_zero + a.arrival_s, config, bandwidth, planes))
    for node, jobs in per_node.items():
        nodes.send(node, jobs)
    deadline = time.monotonic() + START_LEAD_S + arrivals[-1].arrival_s + config.request_timeout_s + GRACE_S
    results = nodes.gather(set(node_of), deadline, f"phase {scheme} at load {load:g}", bar)
    rows = [request_row(scheme, load, node_of[rid], t_zero, results[rid]) for rid in node_of]
    lags = [r["sent_unix"] - r["scheduled_unix"] for r in results.values()
            if r.get("sent_unix") is not None and r.get("scheduled_unix") is not None]
    ends = [r[k] for r in results.values() for k in ("full_unix", "anchor_unix", "sent_unix")
            if r.get(k) is not None]
    info = {"phase": number, "scheme": scheme, "load": load, "rate_rps": rate, "start_unix": t_zero,
            "requests": len(rows), "duration_s": (max(ends) - t_zero) if ends else None,
            "max_send_lag_s": max(lags) if lags else None,
            "mean_send_lag_s": sum(lags) / len(lags) if lags else None,
            "peak_egress_gbps": peak_egress_gbps(rows), "planes": _planes_ran(results, scheme),
            "drained": False}
    if any(r.status != Status.COMPLETED.value for r in rows):
        # requests the prefill node may still be working on must not spill into the next
        # phase: one more request, answered after what it queued before (best effort)
        _one(nodes, config, f"drain-{number}", 0, "int8", 0, bandwidth, planes)
        info["drained"] = True
    return rows, info

