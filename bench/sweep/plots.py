"""The sweep's two plots: time to first token against bandwidth (log-log, median with
min-max bars) and accuracy per scheme. matplotlib is imported lazily with the Agg backend.

In the TTFT plot every scheme has one colour; each LYNX split (``lynx``, ``lynx-3``,
``lynx-2.2.4``, ...) draws two lines in its colour: ``ttft_s`` (first tentative
token, solid) and ``ttfct_s`` (first committed token, dashed). The other schemes
commit their first token, so their one line is both clocks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lynx_bench.sweep.config import is_lynx
from lynx_bench.sweep.results import Row, order_schemes

__all__ = ["plot_ttft_vs_bandwidth", "plot_accuracy", "SCHEME_ORDER", "scheme_colors"]

SCHEME_ORDER = ("bf16", "int8", "int4", "lynx")
#: baselines keep their colours however many LYNX splits a sweep has
_BASE_COLORS = {"bf16": "tab:blue", "int8": "tab:orange", "int4": "tab:green"}
_LYNX_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def _pyplot():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _schemes(rows: Sequence[Row]) -> list[str]:
    """Baselines (bf16, int8, int4), then the LYNX splits as they first appear, then the rest."""
    return order_schemes(r.scheme for r in rows)


def scheme_colors(schemes: Sequence[str]) -> dict[str, str]:
    """A colour per scheme: fixed for the baselines, one per LYNX split in order."""
    out, lynx = {}, 0
    extra = iter(("tab:gray", "black", "gold", "navy"))
    for scheme in schemes:
        if scheme in _BASE_COLORS:
            out[scheme] = _BASE_COLORS[scheme]
        elif is_lynx(scheme):
            out[scheme] = _LYNX_COLORS[lynx % len(_LYNX_COLORS)]
            lynx += 1
        else:
            out[scheme] = next(extra, "black")
    return out


def _median(vals: list[float]) -> float:
    vals = sorted(vals)
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])


def _series(rows: Sequence[Row], scheme: str, ctx: int, field: str) -> tuple[list[float], list[float],
                                                                             list[list[float]]]:
    """Bandwidths, medians and min-max error bars of ``field`` (missing values skipped)."""
    bws, med, lo, hi = [], [], [], []
    for bw in sorted({r.bandwidth_gbps for r in rows if r.scheme == scheme and r.context == ctx}):
        vals = [v for r in rows if r.scheme == scheme and r.context == ctx and r.bandwidth_gbps == bw
                and (v := getattr(r, field)) is not None]
        if not vals:
            continue
        m = _median(vals)
        bws.append(bw)
        med.append(m)
        lo.append(m - min(vals))
        hi.append(max(vals) - m)
    return bws, med, [lo, hi]


def plot_ttft_vs_bandwidth(rows: Sequence[Row], path: Path) -> Path:
    """Median ``ttft_s`` per scheme against bandwidth, min-max bars, one panel per
    context; for each LYNX split also ``ttfct_s`` (committed), dashed, same colour."""
    plt = _pyplot()
    contexts = sorted({r.context for r in rows})
    schemes = _schemes(rows)
    colors = scheme_colors(schemes)
    fig, axes = plt.subplots(1, len(contexts), figsize=(8.5 * len(contexts), 4.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for scheme in schemes:
            lynx = is_lynx(scheme)
            bws, med, err = _series(rows, scheme, ctx, "ttft_s")
            if bws:
                ax.errorbar(bws, med, yerr=err, marker="o", capsize=3, color=colors[scheme],
                            label=f"{scheme} ttft_s (tentative)" if lynx else f"{scheme} ttft_s")
            if lynx:
                bws, med, err = _series(rows, scheme, ctx, "ttfct_s")
                if bws:
                    ax.errorbar(bws, med, yerr=err, marker="s", capsize=3, color=colors[scheme],
                                linestyle="--", mfc="none", label=f"{scheme} ttfct_s (committed)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth (Gbit/s)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"context {ctx} tokens: tentative (solid) and committed (dashed)")
        ax.grid(True, which="both", alpha=0.3)
        # beside the panel: with several splits the legend would cover the lines
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


_ACCURACY_TITLE = {"passkey": "pass-key accuracy", "generation": "tokens equal to BF16's (real text)",
                   "fidelity": "teacher-forced top-1 agreement with BF16"}


def plot_accuracy(rows: Sequence[Row], path: Path, *, workload: str = "passkey") -> Path:
    """Mean accuracy (the sweep ``workload``'s) and agreement with INT8 per scheme (bars), per context."""
    plt = _pyplot()
    schemes = _schemes(rows)
    contexts = sorted({r.context for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, 2 * len(contexts))
    for ci, ctx in enumerate(contexts):
        for mi, (metric, hatch) in enumerate((("accuracy", ""), ("agreement_vs_int8", "//"))):
            vals = []
            for scheme in schemes:
                got = [getattr(r, metric) for r in rows
                       if r.scheme == scheme and r.context == ctx and getattr(r, metric) is not None]
                vals.append(sum(got) / len(got) if got else 0.0)
            offset = (2 * ci + mi) * width - 0.4 + width / 2
            ax.bar([i + offset for i in range(len(schemes))], vals, width, hatch=hatch,
                   label=f"{metric} @ {ctx}")
    ax.set_xticks(range(len(schemes)), schemes, rotation=20 if len(schemes) > 5 else 0)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction")
    ax.set_title(f"accuracy ({_ACCURACY_TITLE.get(workload, workload)}) and agreement with INT8 decoding",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
