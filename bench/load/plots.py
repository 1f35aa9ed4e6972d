"""``lynx load``'s plots: the CDF of ``ttft_s`` per scheme at each load, and p99
``ttft_s`` (solid) and p99 full-cache time (dashed) against offered load.
``names``: what the legends call a scheme (``lynx_bench.load.cli.scheme_names``: LYNX with
the split it ran, ``lynx int8`` when auto chose none). matplotlib is imported
lazily with the Agg backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from lynx_bench.load.results import RequestRow, Status, SummaryRow
from lynx_bench.sweep.plots import SCHEME_ORDER

__all__ = ["plot_ttft_cdf", "plot_p99_vs_load"]


def _pyplot():
    import matplotlib  # noqa: PLC0415 - an optional extra (bench), loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _ordered(schemes: set[str]) -> list[str]:
    return [s for s in SCHEME_ORDER if s in schemes] + sorted(schemes - set(SCHEME_ORDER))


def plot_ttft_cdf(rows: Sequence[RequestRow], path: Path, names: Mapping[str, str] | None = None) -> Path:
    """One panel per load: the empirical CDF of the completed requests' ``ttft_s``, one
    line per scheme (log time axis)."""
    plt = _pyplot()
    names = names or {}
    loads = sorted({r.load for r in rows})
    fig, axes = plt.subplots(1, max(1, len(loads)), figsize=(5.5 * max(1, len(loads)), 4.2),
                             squeeze=False, sharey=True)
    for ax, load in zip(axes[0], loads):
        for scheme in _ordered({r.scheme for r in rows if r.load == load}):
            xs = sorted(r.ttft_s for r in rows if r.load == load and r.scheme == scheme
                        and r.status == Status.COMPLETED.value and r.ttft_s is not None)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=f"{names.get(scheme, scheme)} ({len(xs)})")
        ax.set_xscale("log")
        ax.set_xlabel("ttft_s from the request (s)")
        ax.set_title(f"offered load {load:.2f}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel("fraction of completed requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_p99_vs_load(summary: Sequence[SummaryRow], path: Path, names: Mapping[str, str] | None = None) -> Path:
    """p99 ``ttft_s`` (solid) and p99 time to the full cache (dashed) per scheme against load."""
    plt = _pyplot()
    names = names or {}
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, scheme in enumerate(_ordered({s.scheme for s in summary})):
        points = sorted((s.load, s.p99_ttft_s, s.p99_full_s) for s in summary if s.scheme == scheme)
        color, name = f"C{i}", names.get(scheme, scheme)
        ttft = [(x, y) for x, y, _ in points if y is not None]
        full = [(x, z) for x, _, z in points if z is not None]
        if ttft:
            ax.plot(*zip(*ttft), marker="o", color=color, label=f"{name} p99 ttft_s")
        if full and scheme == "lynx":  # the other schemes' full time is their ttft
            ax.plot(*zip(*full), marker="s", linestyle="--", color=color, label=f"{name} p99 full cache")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (fraction of the link, INT8 bytes)")
    ax.set_ylabel("p99 from the request (s)")
    ax.set_title("tail latency under load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
