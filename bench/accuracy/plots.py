"""``accuracy.png``: per workload, bars per scheme (mean over the cases, standard-error
bars), one bar per context and headline metric (:data:`~lynx_bench.accuracy.config.HEADLINE`);
with a sweep's rows, a second row of panels: the paper's two axes, accuracy against
the median time to first token at the sweep's slowest link, per context (a LYNX
split drawn at its first tentative token, filled, and its first committed one,
hollow, joined). matplotlib is imported lazily with the Agg backend."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from ..sweep.config import DEFAULT_PLANES, is_lynx
from ..sweep.plots import scheme_colors
from ..sweep.results import Row, order_schemes
from .config import HEADLINE, Workload
from .report import AccuracyRow, SummaryRow, summarize

__all__ = ["plot_accuracy_report", "ttft_points"]

_HATCHES = ("", "//", "..", "xx")


def _pyplot():
    import matplotlib  # noqa: PLC0415 - the bench extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _split_of(scheme: str) -> str | None:
    """A LYNX scheme name's split as the sweep's ``planes`` column writes it
    (``lynx`` -> ``4,4``, ``lynx-3`` -> ``3,5``, ``lynx-2.2.4`` -> ``2,2,4``)."""
    if scheme == "lynx":
        widths = DEFAULT_PLANES
    elif is_lynx(scheme):
        parts = scheme[len("lynx-"):].split(".")
        if not all(p.isdigit() for p in parts):
            return None
        widths = tuple(int(p) for p in parts)
        widths = (widths[0], 8 - widths[0]) if len(widths) == 1 else widths
    else:
        return None
    return ",".join(map(str, widths))


def ttft_points(rows: Sequence[Row], context: int) -> tuple[float | None, dict[str, tuple[float, float | None]]]:
    """The sweep's slowest bandwidth and, per scheme at that bandwidth and ``context``,
    the median ``ttft_s`` and ``ttfct_s`` (None when missing). A LYNX split is found
    under its sweep name and under its split (``lynx-4`` of a two-split sweep is the
    report's ``lynx``)."""
    at = [r for r in rows if r.context == context]
    if not at:
        return None, {}
    bw = min(r.bandwidth_gbps for r in at)
    out: dict[str, tuple[float, float | None]] = {}
    for scheme in order_schemes(r.scheme for r in at):
        runs = [r for r in at if r.scheme == scheme and r.bandwidth_gbps == bw]
        if not runs:
            continue
        committed = [r.ttfct_s for r in runs if r.ttfct_s is not None]
        out[scheme] = (statistics.median(r.ttft_s for r in runs),
                       statistics.median(committed) if committed else None)
        if runs[0].planes is not None:
            out.setdefault(f"planes {runs[0].planes}", out[scheme])
    return bw, out


def _bars(ax, summary: list[SummaryRow], workload: Workload, colors: dict[str, str]) -> None:
    cells = {(s.context, s.scheme, s.metric): s for s in summary if s.workload == workload.value}
    schemes = order_schemes(s for _, s, _ in cells)
    series = [(ctx, m) for ctx in sorted({c for c, _, _ in cells}) for m in HEADLINE[workload]
              if any((ctx, s, m) in cells for s in schemes)]
    width = 0.8 / max(1, len(series))
    low = 1.0
    for si, (ctx, metric) in enumerate(series):
        offset = si * width - 0.4 + width / 2
        xs, ys, errs, cs = [], [], [], []
        for i, scheme in enumerate(schemes):
            cell = cells.get((ctx, scheme, metric))
            if cell is None:
                continue
            xs.append(i + offset)
            ys.append(cell.mean)
            errs.append(cell.stderr or 0.0)
            cs.append(colors[scheme])
            low = min(low, cell.mean - (cell.stderr or 0.0))
        ctx_i = sorted({c for c, _ in series}).index(ctx)
        ax.bar(xs, ys, width, yerr=errs, capsize=3, color=cs, edgecolor="black", linewidth=0.5,
               alpha=1.0 - 0.35 * ctx_i / max(1, len({c for c, _ in series}) - 1 or 1),
               hatch=_HATCHES[HEADLINE[workload].index(metric) % len(_HATCHES)],
               label=f"{metric} @ {ctx}")
    ax.set_xticks(range(len(schemes)), schemes)
    ax.set_ylim(max(0.0, low - 0.15 * (1.0 - low) - 0.02), 1.0 + 0.01)
    ax.set_ylabel("mean over cases (± stderr)")
    ax.set_title(f"{workload.value}")
    ax.grid(True, axis="y", alpha=0.3)
    if series:  # below the panel: the bars fill it
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)


def _scatter(ax, summary: list[SummaryRow], sweep_rows: Sequence[Row], ctx: int, colors: dict[str, str]) -> None:
    workload = next((w for w in Workload if any(s.workload == w.value and s.context == ctx
                                                and s.metric == HEADLINE[w][0] for s in summary)), None)
    if workload is None:
        return
    metric = HEADLINE[workload][0]
    acc = {s.scheme: s for s in summary if s.workload == workload.value and s.context == ctx and s.metric == metric}
    bw, points = ttft_points(sweep_rows, ctx)
    for scheme, cell in acc.items():
        point = points.get(scheme) or points.get(f"planes {_split_of(scheme)}")
        if point is None:
            continue
        ttft, ttfct = point
        color = colors.get(scheme, "black")
        ax.errorbar([ttft], [cell.mean], yerr=[cell.stderr or 0.0], marker="o", color=color, capsize=3,
                    label=f"{scheme} first token" if is_lynx(scheme) else scheme)
        if is_lynx(scheme) and ttfct is not None:
            ax.plot([ttft, ttfct], [cell.mean, cell.mean], color=color, linestyle="--")
            ax.plot([ttfct], [cell.mean], marker="s", mfc="none", color=color, linestyle="none",
                    label=f"{scheme} first committed")
    ax.set_xlabel(f"median time to first token at {bw:g} Gbit/s (s)" if bw is not None else "time to first token (s)")
    ax.set_ylabel(f"{workload.value}: {metric}")
    ax.set_title(f"accuracy vs TTFT, context {ctx}")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_accuracy_report(rows: Sequence[AccuracyRow], path: Path, *, sweep_rows: Sequence[Row] | None = None) -> Path:
    """Draw ``accuracy.png`` (module docstring) from the report's rows; returns ``path``."""
    plt = _pyplot()
    summary = summarize(rows)
    workloads = [w for w in Workload if any(s.workload == w.value for s in summary)]
    colors = scheme_colors(order_schemes(s.scheme for s in summary))
    contexts = sorted({s.context for s in summary})
    scatter = [] if sweep_rows is None else [c for c in contexts if any(r.context == c for r in sweep_rows)]
    ncols = max(1, len(workloads), len(scatter))
    nrows = 2 if scatter else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        _bars(ax, summary, workload, colors)
    for ax, ctx in zip(axes[1] if scatter else [], scatter):
        _scatter(ax, summary, sweep_rows or [], ctx, colors)
    for row in axes:
        for ax in row:
            if not ax.has_data():
                ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
