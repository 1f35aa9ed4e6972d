"""The metrics of one decode-node run (docs/design.md names), from its stream's
:class:`~lynx_decode.kvassembler.KVAssembler`, the engine's
:class:`~lynx_decode.events.DecodeMetrics` and the node's clocks.
"""

from __future__ import annotations

from typing import Any

from lynx_decode.kvassembler import KVAssembler
from lynx_decode.kvheader import lane_of
from lynx_transport import Lane

__all__ = ["run_metrics"]


def run_metrics(assembler: KVAssembler, gen: Any, lane_done: dict[int, float],
                first_token: list[float], requested_at: float) -> dict[str, Any]:
    """The metrics of a finished run: ``gen`` the engine's :class:`~lynx_decode.decode_config.Generation`,
    ``lane_done`` when each lane completed, ``first_token`` when the first token went
    out (empty: none did), ``requested_at`` when the node sent its request (wall clock)."""
    m = gen.metrics
    t0 = assembler.header.t0_unix
    out: dict[str, Any] = {
        # the request's id, as the prefill node's SendRecord names it
        "request_id": assembler.header.request_id,
        "scheme": assembler.scheme.value,
        "prompt_tokens": assembler.header.prompt_tokens,
        "ttft_s": m.ttft_s, "ttfct_s": m.ttfct_s, "e2e_s": m.e2e_s,
        "acceptance_rate": m.acceptance_rate, "drafted": m.drafted, "accepted": m.accepted,
        "new_tokens": m.new_tokens, "stopped_at_eos": m.stopped_at_eos,
        "verified": m.verified, "unverified_reason": m.unverified_reason,
        "dequant_s": assembler.dequant_s,
        "draft_ready_s": (assembler.timings["draft_ready"] - t0
                          if "draft_ready" in assembler.timings else None),
        "full_ready_s": (assembler.timings["full_ready"] - t0
                         if "full_ready" in assembler.timings else None),
        # the first token out: tentative, or committed when the first pass read exact K/V
        # in every layer (then no verify pass ran)
        "first_tentative_s": first_token[0] - t0 if first_token else None,
        "first_token_committed": m.first_token_committed, "verify_passes": m.verify_passes,
        "first_pass_levels": list(m.first_pass_levels),
        # when the first anchor region landed (t0 to it: the prefill node's
        # encoding if it encodes on the way out, the opening of the stream, one region)
        "first_anchor_s": (assembler.timings["plane0_first"] - t0
                           if "plane0_first" in assembler.timings else None),
        # when the first region of plane 1 (the residual's first plane) landed
        "first_residual_s": (assembler.timings["plane1_first"] - t0
                             if "plane1_first" in assembler.timings else None),
        # the engine: when it took the full cache (after its draft step in progress)
        # and how long the one verification pass took
        "full_taken_s": m.full_ready_s, "verify_s": m.verify_s,
        # when the engine's first (drafting) step started; None when it did not draft
        "draft_start_s": m.draft_start_s,
        # the shared wall clock's t0 (the prefill node's), and when each region of each
        # plane landed (seconds from t0, per plane, in arrival order)
        "t0_unix": t0,
        "arrivals_s": [[t - t0 for t in times] for times in assembler.arrivals],
        # bytes of one layer's region per plane (the largest layer's: sliding-window
        # layers send less, see layer_bytes), and of every layer's, [plane][layer]
        "region_bytes": [max(sizes) for sizes in assembler.layer_bytes],
        "layer_bytes": [list(sizes) for sizes in assembler.layer_bytes],
        # what the same scheme would have sent with every layer whole (no window)
        "bytes_naive": assembler.header.naive_bytes(),
        "layer_windows": [g.window for g in assembler.header.geometry],
    }
    # "anchor" is lane 0, "residual" every later plane's lane together (done when the last is)
    anchor_lane = int(Lane.ANCHOR)
    later = [lane_of(p) for p in range(1, assembler.num_planes)]
    out["bytes_anchor"] = sum(r.nbytes for r in assembler.stream.regions if r.lane == anchor_lane)
    out["bytes_residual"] = sum(r.nbytes for r in assembler.stream.regions if r.lane != anchor_lane)
    out["transfer_anchor_s"] = lane_done[anchor_lane] - t0 if anchor_lane in lane_done else None
    out["transfer_residual_s"] = (max(lane_done[lane] for lane in later) - t0
                                  if later and all(lane in lane_done for lane in later) else None)
    out["bytes_total"] = out["bytes_anchor"] + out["bytes_residual"]
    # The clock a user under load feels: from the moment this node sent its request,
    # so the prefill node's queue and prefill count (the *_s above start at t0).
    queue_s = t0 - requested_at
    out["queue_s"] = queue_s
    for name in ("ttft", "ttfct", "e2e"):
        value = out[f"{name}_s"]
        out[f"{name}_from_request_s"] = None if value is None else value + queue_s
    # one decode step on the exact cache: the greedy steps after the first commit
    # (which held the accepted drafts plus one token)
    steps = m.new_tokens - 1 - m.accepted
    out["step_s"] = None if m.ttfct_s is None or steps < 1 else (m.e2e_s - m.ttfct_s) / steps
    return out
