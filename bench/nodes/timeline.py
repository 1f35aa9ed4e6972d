"""``lynx generate --timeline run.png``: one run on one time axis.

The picture is built from the run's ``--json`` dict (:func:`timeline_figure`), so a
saved run can be drawn again. Time is seconds from ``t0`` (the prefill node holds
the cache, docs/design.md), on the wall clock both nodes share. Two panels share it:

- bytes landed per lane: one step line per plane (the anchor's lane, then each
  residual plane's), from the per-region arrival times the decode node reports
  (``arrivals_s``, ``region_bytes``); dotted lines where the anchor-only cache
  (``draft_ready_s``) and the exact cache (``full_ready_s``) were complete;
- the engine and the tokens: shaded spans for the first step, drafting, the
  verify pass and decoding on the exact cache (on the anchors only, for an
  unverified run), and one marker per token event at its position: tentative
  (hollow), withdrawn by a rollback (red x, at the rollback), committed (filled),
  unverified (triangles); dashed lines at ``ttft_s`` and ``ttfct_s``.

The token events come from the decode node's ``on_event`` callback, stamped on the
same clock (:func:`token_events`). matplotlib is imported lazily; the figure is a
plain :class:`matplotlib.figure.Figure` (no pyplot state, no display).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lynx_decode.events import Committed, Done, Event, Rollback, Tentative, Unverified

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["token_events", "timeline_figure", "write_timeline", "FORMATS"]

#: file suffixes ``--timeline`` writes
FORMATS = (".png", ".svg", ".pdf")

_PHASE_COLORS = {"first step": "tab:blue", "drafting": "tab:purple", "verify pass": "tab:red",
                 "decoding (exact cache)": "tab:green", "decoding (anchors only)": "tab:orange"}


def token_events(timed: Sequence[tuple[float, Event]], t0_unix: float) -> list[dict[str, Any]]:
    """The token events of a run, JSON-ready: ``t_s`` (seconds from ``t0_unix``),
    ``kind`` (tentative, rollback, committed, unverified), ``position`` and
    ``tokens`` (for a rollback: ``n_rejected``). ``timed``: (``time.time()`` when
    it came, event); :class:`Done` is left out."""
    out: list[dict[str, Any]] = []
    for when, event in timed:
        t_s = when - t0_unix
        if isinstance(event, Tentative):
            out.append({"t_s": t_s, "kind": "tentative", "position": event.position, "tokens": [event.token]})
        elif isinstance(event, Rollback):
            out.append({"t_s": t_s, "kind": "rollback", "position": event.from_position,
                        "n_rejected": event.n_rejected})
        elif isinstance(event, (Committed, Unverified)):
            kind = "committed" if isinstance(event, Committed) else "unverified"
            out.append({"t_s": t_s, "kind": kind, "position": event.position, "tokens": list(event.tokens)})
        elif not isinstance(event, Done):  # pragma: no cover - a new event type
            raise TypeError(f"unknown event {event!r}")
    return out


def _lane_label(plane: int, planes: Sequence[int] | None, scheme: str) -> str:
    if not planes:
        return f"{scheme} (one lane)"
    width = planes[plane] if plane < len(planes) else "?"
    return f"anchor (plane 0, {width} bit)" if plane == 0 else f"residual plane {plane} ({width} bit)"


def _phases(run: Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """(name, start, end) of the engine's phases, seconds from t0."""
    ttft, ttfct, e2e = run.get("ttft_s"), run.get("ttfct_s"), run.get("e2e_s")
    taken, verify = run.get("full_taken_s"), run.get("verify_s")
    out: list[tuple[str, float, float]] = []
    if ttft is None or e2e is None:
        return out
    drafted = run.get("draft_start_s") is not None
    if not drafted:  # one cache: the first step starts when the engine takes it, and commits
        if taken is not None:
            out.append(("first step", taken, ttft))
        out.append(("decoding (exact cache)", ttft, e2e))
        return [p for p in out if p[2] > p[1]]
    out.append(("first step", run["draft_start_s"], ttft))
    if ttfct is None:  # unverified: the exact cache never came
        out.append(("decoding (anchors only)", ttft, e2e))
        return out
    if taken is not None:
        out.append(("drafting", ttft, taken))
        if verify is not None:
            out.append(("verify pass", taken, taken + verify))
    out.append(("decoding (exact cache)", ttfct, e2e))
    return [p for p in out if p[2] > p[1]]


def _unit(total: float) -> tuple[str, float]:
    for name, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= scale:
            return name, scale
    return "B", 1.0


def _bytes_panel(ax: Axes, run: Mapping[str, Any]) -> None:
    arrivals: Sequence[Sequence[float]] = run.get("arrivals_s") or []
    sizes: Sequence[int] = run.get("region_bytes") or []
    unit, scale = _unit(max([len(t) * s for t, s in zip(arrivals, sizes)], default=0))
    for plane, times in enumerate(arrivals):
        size = sizes[plane] if plane < len(sizes) else 0
        xs = [0.0, *sorted(times)]
        ys = [i * size / scale for i in range(len(xs))]
        ax.step(xs, ys, where="post", linewidth=1.8,
                label=_lane_label(plane, run.get("planes"), str(run.get("scheme", "?"))))
    for key, text in (("draft_ready_s", "anchor-only cache complete"), ("full_ready_s", "exact cache complete")):
        if run.get(key) is not None and (key != "draft_ready_s" or len(arrivals) > 1):
            ax.axvline(run[key], color="gray", linestyle=":", linewidth=1.2, label=f"{text} ({run[key]:.3f} s)")
    ax.set_ylabel(f"bytes landed per lane ({unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _token_panel(ax: Axes, run: Mapping[str, Any]) -> None:
    for name, start, end in _phases(run):
        ax.axvspan(start, end, color=_PHASE_COLORS[name], alpha=0.15, label=name)
    points: dict[str, tuple[list[float], list[int]]] = {k: ([], []) for k in
                                                        ("tentative", "withdrawn", "committed", "unverified")}
    for e in run.get("token_events") or []:
        if e["kind"] == "rollback":
            count, kind = e["n_rejected"], "withdrawn"
        else:
            count, kind = len(e["tokens"]), e["kind"]
        xs, ys = points[kind]
        xs.extend([e["t_s"]] * count)
        ys.extend(range(e["position"], e["position"] + count))
    style: dict[str, dict[str, Any]] = {
        "tentative": {"marker": "o", "mfc": "none", "color": "gray"},
        "withdrawn": {"marker": "x", "color": "tab:red"},
        "committed": {"marker": "o", "color": "tab:green"},
        "unverified": {"marker": "^", "color": "tab:orange"},
    }
    for kind, (xs, ys) in points.items():
        if xs:
            ax.plot(xs, ys, linestyle="none", markersize=5, label=f"{kind} token", **style[kind])
    for key, color in (("ttft_s", "black"), ("ttfct_s", "tab:green")):
        if run.get(key) is not None:
            ax.axvline(run[key], color=color, linestyle="--", linewidth=1.0, label=f"{key} {run[key]:.3f}")
    ax.set_ylabel("token position")
    ax.set_xlabel("seconds from t0 (the prefill node holds the cache)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def timeline_figure(run: Mapping[str, Any], *, title: str | None = None) -> Figure:
    """The run's timeline (a ``lynx generate --json`` dict with ``token_events``)."""
    from matplotlib.figure import Figure  # noqa: PLC0415 - matplotlib loads only for plots

    fig = Figure(figsize=(11, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1.0, 1.2])
    _bytes_panel(top, run)
    _token_panel(bottom, run)
    ends = [run.get("e2e_s") or 0.0, *(t for times in run.get("arrivals_s") or [] for t in times),
            *(e["t_s"] for e in run.get("token_events") or [])]
    starts = [0.0, *(p[1] for p in _phases(run))]
    span = max(ends) - min(starts)
    bottom.set_xlim(min(starts) - 0.01 * span, max(ends) + 0.02 * span)
    top.set_title(title if title is not None else f"{run.get('scheme', '?')}: "
                  f"{run.get('prompt_tokens', '?')} prompt tokens")
    fig.tight_layout()
    return fig


def write_timeline(path: Path, run: Mapping[str, Any], *, title: str | None = None) -> Path:
    """Draw :func:`timeline_figure` into ``path`` (format from its suffix, :data:`FORMATS`)."""
    timeline_figure(run, title=title).savefig(path, dpi=110, bbox_inches="tight")
    return path
