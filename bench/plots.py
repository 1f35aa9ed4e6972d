"""The sweep's two plots: TTFT against bandwidth (log-log, median with min-max bars)
and accuracy per scheme. matplotlib is imported lazily with the Agg backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lynx_bench.results import Row

__all__ = ["plot_ttft_vs_bandwidth", "plot_accuracy", "SCHEME_ORDER"]

SCHEME_ORDER = ("bf16", "int8", "int4", "lynx")


def _pyplot():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _schemes(rows: Sequence[Row]) -> list[str]:
    present = {r.scheme for r in rows}
    return [s for s in SCHEME_ORDER if s in present] + sorted(present - set(SCHEME_ORDER))


def plot_ttft_vs_bandwidth(rows: Sequence[Row], path: Path) -> Path:
    """Median ``ttft_s`` per scheme against bandwidth, min-max bars, one panel per context."""
    plt = _pyplot()
    contexts = sorted({r.context for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for scheme in _schemes(rows):
            bws = sorted({r.bandwidth_gbps for r in rows if r.scheme == scheme and r.context == ctx})
            med, lo, hi = [], [], []
            for bw in bws:
                vals = sorted(r.ttft_s for r in rows
                              if r.scheme == scheme and r.context == ctx and r.bandwidth_gbps == bw)
                m = vals[len(vals) // 2] if len(vals) % 2 else 0.5 * (vals[len(vals) // 2 - 1] + vals[len(vals) // 2])
                med.append(m)
                lo.append(m - vals[0])
                hi.append(vals[-1] - m)
            ax.errorbar(bws, med, yerr=[lo, hi], marker="o", capsize=3, label=scheme)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth (Gbit/s)")
        ax.set_ylabel("time to first token, ttft_s (s)")
        ax.set_title(f"context {ctx} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accuracy(rows: Sequence[Row], path: Path) -> Path:
    """Mean pass-key accuracy and agreement with INT8 per scheme (bars), per context."""
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
    ax.set_xticks(range(len(schemes)), schemes)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction")
    ax.set_title("pass-key accuracy and agreement with INT8 decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
