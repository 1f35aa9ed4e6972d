"""The pure parts of ``make vllm-bench`` (:mod:`lynx_bench.vllm.bench`): what its flags mean, the
request rate, and ``summary.json``'s rows built from vLLM's benchmark result and the proxy's and
the consumer's records; the table and the plot. No I/O but the plot's file, no vLLM imports (the
unit tests run it in Lynx's main environment).

A row of ``summary.json`` (one per configuration, rate and link; fixed fields, so runs compare
across commits)::

    {"connector": "none|nixl|lynx", "scheme": "bf16|int8|int4|lynx|null", "load": "sync|async|null",
     "link_gbps": float | null (unshaped), "link_shaping": "netns-tc|unshaped", "rate": float,
     "requests": n, "completed": n, "failed": n,
     "ttft_ms": {"mean", "median", "p99"}, "tpot_ms": {...}, "itl_ms": {...}, "e2el_ms": {...},
     "consumer_ttft_ms": {"median", "p99"}, "equal_to_int8": bool | null,
     "tpot_unloaded_ms": {"idle": {"median", "p99"}, "beside_prefills": {...}} | null,
     "pulled": ["int8" | "lynx 4,4" | ...] | null}

``ttft_ms`` ... ``e2el_ms`` are vLLM's (its ``--save-result`` JSON, the client's clock, the
producer's prefill included). ``link_shaping`` (:func:`link_shaping`): ``netns-tc``, the
producer and the consumer each in a namespace of a ``lynx link up --hosts 2`` link, every byte
between them through tc's htb at ``link_gbps`` (Lynx's own shaper off); ``unshaped``, loopback.
``consumer_ttft_ms`` is the decode leg's: from the proxy sending it
(``decode_sent_at``) to the first bytes of its answer (``decode_first_byte_at``, a streamed
answer's first token), per request from the proxy's records; null without a proxy (``none``).
``equal_to_int8``: for the ``lynx`` scheme, whether every request's text equals the ``int8``
run's at the same link and load mode (same seeded prompts, greedy); null elsewhere or without
an ``int8`` run. ``tpot_unloaded_ms``: for an asynchronous configuration, the same consumer's
TPOT with no load beside it (a few requests one at a time through the same proxy, before the
measured run; ``idle`` with nothing else running, ``beside_prefills`` with the producer prefilling
other prompts at the run's rate), against which its loaded ``tpot_ms`` p99 is judged; null for the
others. ``pulled``: what the consumer's loads pulled, each form once (a ``lynx`` row with the
default ``planes: auto`` pulls ``int8`` in vLLM, :func:`lynx_vllm.config.resolve_split`); null
without load records. What the records of a run say beyond the row (where each TTFT goes, what ran beside each
decode, the loads' wire rate) is :mod:`lynx_bench.vllm.bench_records`. A
configuration that could not run (e.g. NIXL not installed) has a row with ``completed: 0``, its
metrics null, and its exact error in ``config["errors"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lynx_bench.vllm.bench_records import consumer_ttfts, median_p99

__all__ = ["Connector", "BenchConfig", "CONFIG_NAMES", "SCHEMES", "AUTO_RATE_FRACTION", "parse_configs",
           "parse_links", "parse_rate", "link_shaping", "LINK_SHAPINGS", "auto_rate", "rate_rule", "metric",
           "run_row", "failed_row", "fill_equal_to_int8", "table", "plot_ttft", "main"]

#: The schemes the proxy's ``--scheme`` takes.
SCHEMES = ("bf16", "int8", "int4", "lynx")
#: ``--rate auto``: this fraction of the producer's measured prefill throughput.
AUTO_RATE_FRACTION = 0.7
METRICS = ("ttft", "tpot", "itl", "e2el")


class Connector(enum.Enum):
    """How a configuration's prompt gets to the server that decodes it."""

    NONE = "none"    # one plain vLLM server: it prefills and decodes
    NIXL = "nixl"    # vLLM's NixlConnector, a producer and a consumer (kv_both)
    LYNX = "lynx"    # LynxConnector, a producer and a consumer


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One configuration of ``--configs``: ``none``, ``nixl`` or ``lynx-<scheme>[-async]``."""

    name: str
    connector: Connector
    scheme: str | None = None
    load: str | None = None

    @property
    def backend(self) -> tuple[Connector, str | None]:
        """What its servers are (the Lynx configurations of one load mode share a producer and a
        consumer; only the proxy's ``--scheme`` differs)."""
        return self.connector, self.load


CONFIG_NAMES = ("none", "nixl", *(f"lynx-{s}" for s in SCHEMES), *(f"lynx-{s}-async" for s in SCHEMES))


def _config(name: str) -> BenchConfig:
    if name == "none":
        return BenchConfig(name, Connector.NONE)
    if name == "nixl":
        return BenchConfig(name, Connector.NIXL)
    parts = name.split("-")
    if len(parts) in (2, 3) and parts[0] == "lynx" and parts[1] in SCHEMES and parts[2:] in ([], ["async"]):
        return BenchConfig(name, Connector.LYNX, parts[1], "async" if parts[2:] else "sync")
    raise argparse.ArgumentTypeError(
        f"unknown configuration {name!r}: the configurations are none, nixl and lynx-<scheme>[-async] with "
        f"<scheme> one of {', '.join(SCHEMES)} (e.g. none,lynx-int8,lynx-lynx)")


def parse_configs(text: str) -> tuple[BenchConfig, ...]:
    """``--configs``: comma-separated names (:data:`CONFIG_NAMES`), each once, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--configs names at least one configuration (e.g. none,lynx-int8)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"--configs names {', '.join(twice)} more than once")
    return tuple(_config(n) for n in names)


#: ``link_shaping`` values: tc on a ``lynx link up`` namespace link, or loopback.
LINK_SHAPINGS = ("netns-tc", "unshaped")


def link_shaping(link_gbps: float | None) -> str:
    """How a row's link was shaped: a rate runs through a ``lynx link up --hosts 2`` link
    (``netns-tc``); no rate is loopback (``unshaped``)."""
    return "unshaped" if link_gbps is None else "netns-tc"


def parse_links(text: str) -> tuple[float | None, ...]:
    """``--links``: comma-separated, ``unshaped`` (None) or a rate in Gbit/s, held by tc on a
    ``lynx link up --hosts 2`` namespace link (:func:`link_shaping`); each once."""
    out: list[float | None] = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        if item == "unshaped":
            link: float | None = None
        else:
            try:
                link = float(item)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"a link is 'unshaped' or a rate in Gbit/s (e.g. 0.5), got {item!r}") from None
            if not math.isfinite(link) or link <= 0:
                raise argparse.ArgumentTypeError(f"a link's rate must be a positive number of Gbit/s, got {item!r}")
        if link in out:
            raise argparse.ArgumentTypeError(f"--links names {item} more than once")
        out.append(link)
    if not out:
        raise argparse.ArgumentTypeError("--links names at least one link (e.g. unshaped)")
    return tuple(out)


def parse_rate(text: str) -> float | None:
    """``--rate``: ``auto`` (None: :func:`auto_rate` of a measured prefill) or requests per second > 0."""
    if text.strip() == "auto":
        return None
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate is 'auto' or requests per second (e.g. 0.1), got {text!r}") from None
    if not math.isfinite(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"--rate must be a positive, finite number of requests/s, got {text!r}")
    return rate


def auto_rate(prefill_s: float, fraction: float = AUTO_RATE_FRACTION) -> float:
    """``fraction`` of the producer's prefill throughput (one request per ``prefill_s``): on a CPU
    box the producer's prefill, not the link, limits the rate a P/D pair sustains."""
    if not math.isfinite(prefill_s) or prefill_s <= 0:
        raise ValueError(f"a measured prefill takes a positive time, got {prefill_s!r} s")
    if not 0 < fraction <= 1:
        raise ValueError(f"the fraction of the prefill throughput is in (0, 1], got {fraction!r}")
    return fraction / prefill_s


def rate_rule(rate: float | None, prefill_s: float | None, prompt_tokens: int, measured_on: str | None) -> str:
    """The config's sentence on where the rate came from."""
    if rate is not None:
        return f"fixed: --rate {rate:g} requests/s"
    assert prefill_s is not None
    return (f"auto: {AUTO_RATE_FRACTION:g} x the producer's prefill throughput; one {prompt_tokens}-token prefill "
            f"(max_tokens 1) measured on {measured_on} before the runs took {prefill_s:.3f} s, so "
            f"{auto_rate(prefill_s):.4f} requests/s")


def metric(result: Mapping[str, Any], name: str) -> dict[str, float | None]:
    """``{"mean", "median", "p99"}`` of ``name`` (ttft, tpot, itl, e2el) in ms from vLLM's result JSON."""
    def get(key: str) -> float | None:
        value = result.get(f"{key}_{name}_ms")
        return None if value is None else float(value)

    return {"mean": get("mean"), "median": get("median"), "p99": get("p99")}


def run_row(config: BenchConfig, link_gbps: float | None, rate: float, requests: int, result: Mapping[str, Any],
            proxy_records: Iterable[Mapping[str, Any]] | None, prefix: str, *,
            tpot_unloaded: Mapping[str, Mapping[str, float | None]] | None = None,
            pulled: Sequence[str] | None = None) -> dict[str, Any]:
    """One row of ``summary.json`` (``equal_to_int8`` left null: :func:`fill_equal_to_int8`);
    ``tpot_unloaded``: the configuration's unloaded TPOT, if measured, by condition (``idle``, nothing
    beside; ``beside_prefills``, the producer prefilling at the run's rate), each ``{"median", "p99"}``;
    ``pulled``: the forms the consumer's loads pulled (``bench_records.pulled``; a ``lynx`` row with
    ``auto`` pulls ``int8``)."""
    consumer = (median_p99(consumer_ttfts(proxy_records, prefix)) if proxy_records is not None
                else {"median": None, "p99": None})
    return {"connector": config.connector.value, "scheme": config.scheme, "load": config.load,
            "link_gbps": link_gbps, "link_shaping": link_shaping(link_gbps), "rate": rate, "requests": requests,
            "completed": int(result.get("completed", 0)),
            "failed": int(result.get("failed", requests - int(result.get("completed", 0)))),
            **{f"{m}_ms": metric(result, m) for m in METRICS}, "consumer_ttft_ms": consumer, "equal_to_int8": None,
            "tpot_unloaded_ms": None if tpot_unloaded is None else {k: dict(v) for k, v in tpot_unloaded.items()},
            "pulled": None if pulled is None else list(pulled)}


def failed_row(config: BenchConfig, link_gbps: float | None, rate: float | None, requests: int) -> dict[str, Any]:
    """The row of a configuration that did not run: nothing completed, every metric null."""
    none = {"mean": None, "median": None, "p99": None}
    return {"connector": config.connector.value, "scheme": config.scheme, "load": config.load,
            "link_gbps": link_gbps, "link_shaping": link_shaping(link_gbps), "rate": rate, "requests": requests,
            "completed": 0, "failed": requests,
            **{f"{m}_ms": dict(none) for m in METRICS}, "consumer_ttft_ms": {"median": None, "p99": None},
            "equal_to_int8": None, "tpot_unloaded_ms": None, "pulled": None}


def fill_equal_to_int8(rows: Sequence[dict[str, Any]], texts: Sequence[Sequence[str | None] | None]) -> None:
    """Set each ``lynx``-scheme row's ``equal_to_int8``: its per-request texts (``texts[i]``, in the
    benchmark's request order, None for a failed request) against the ``int8`` row's of the same
    link and load mode: True when every request of both succeeded with the same text."""
    for row, mine in zip(rows, texts):
        if row["connector"] != "lynx" or row["scheme"] != "lynx":
            continue
        ref = next((t for r, t in zip(rows, texts) if r["connector"] == "lynx" and r["scheme"] == "int8"
                    and r["link_gbps"] == row["link_gbps"] and r["load"] == row["load"]), None)
        if ref is None or mine is None:
            row["equal_to_int8"] = None
            continue
        row["equal_to_int8"] = (len(mine) == len(ref) and len(mine) > 0
                                and all(a is not None and a == b for a, b in zip(mine, ref)))


def _label(row: Mapping[str, Any]) -> str:
    name = row["connector"] if row["scheme"] is None else f"{row['connector']}-{row['scheme']}"
    return name + ("-async" if row["load"] == "async" else "")


def _link(row: Mapping[str, Any]) -> str:
    return "unshaped" if row["link_gbps"] is None else f"{row['link_gbps']:g}G"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The runs as a fixed-width table (ms; ``-``: not measured; ``unl``: the unloaded TPOT p50 with
    nothing beside, ``unl+pf`` its p99 with the producer prefilling beside at the run's rate)."""
    def ms(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}"

    head = (f"{'config':<17} {'link':>8} {'rate/s':>7} {'ok/fail':>8} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
            f"{'cons p50':>8} {'cons p99':>8} {'TPOT p50':>8} {'p99':>5} {'unl':>5} {'unl+pf':>6} {'ITL p50':>7} "
            f"{'E2EL p50':>8} "
            f"{'=int8':>5} {'pulled':<10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        eq = "-" if r["equal_to_int8"] is None else ("yes" if r["equal_to_int8"] else "NO")
        unloaded = r.get("tpot_unloaded_ms") or {}
        rate = "-" if r["rate"] is None else f"{r['rate']:.3f}"
        lines.append(f"{_label(r):<17} {_link(r):>8} {rate:>7} {r['completed']:>4}/{r['failed']:<3} "
                     f"{ms(r['ttft_ms']['mean']):>9} {ms(r['ttft_ms']['median']):>7} {ms(r['ttft_ms']['p99']):>7} "
                     f"{ms(r['consumer_ttft_ms']['median']):>8} {ms(r['consumer_ttft_ms']['p99']):>8} "
                     f"{ms(r['tpot_ms']['median']):>8} {ms(r['tpot_ms']['p99']):>5} "
                     f"{ms((unloaded.get('idle') or {}).get('median')):>5} "
                     f"{ms((unloaded.get('beside_prefills') or {}).get('p99')):>6} {ms(r['itl_ms']['median']):>7} "
                     f"{ms(r['e2el_ms']['median']):>8} {eq:>5} {'/'.join(r.get('pulled') or ['-']):<10}")
    return "\n".join(lines)


def plot_ttft(summary: Mapping[str, Any], path: Path) -> Path:
    """TTFT p50 (solid) and p99 (dashed) per configuration against the link (the client's clock;
    the consumer's p50 dotted where there is one). matplotlib, lazily, with the Agg backend."""
    import matplotlib  # noqa: PLC0415 - the bench extra, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in summary["runs"] if r["completed"]]
    links = sorted({r["link_gbps"] for r in rows}, key=lambda g: (g is not None, -(g or 0.0)))
    xs = {g: i for i, g in enumerate(links)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3)
    for label in dict.fromkeys(_label(r) for r in rows):
        mine = sorted((r for r in rows if _label(r) == label), key=lambda r: xs[r["link_gbps"]])
        x = [xs[r["link_gbps"]] for r in mine]
        color = next(colors)
        ax.plot(x, [r["ttft_ms"]["median"] for r in mine], "o-", color=color, label=f"{label} p50")
        ax.plot(x, [r["ttft_ms"]["p99"] for r in mine], "s--", color=color, label=f"{label} p99")
        if any(r["consumer_ttft_ms"]["median"] is not None for r in mine):
            ax.plot(x, [r["consumer_ttft_ms"]["median"] for r in mine], "^:", color=color,
                    label=f"{label} consumer p50")
    ax.set_xticks(range(len(links)), ["unshaped" if g is None else f"{g:g} Gbit/s" for g in links])
    ax.set_xlabel("link")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    cfg = summary.get("config", {})
    ax.set_title(f"vllm bench serve: {cfg.get('prompt_tokens')}-token prompts, {cfg.get('requests')} requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m lynx_bench.vllm.bench_summary SUMMARY.json [PLOT.png]``: print the table and write
    the plot (where matplotlib is: the vLLM environment has none, so the runner calls this from
    Lynx's main environment)."""
    import json  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m lynx_bench.vllm.bench_summary", description=main.__doc__)
    p.add_argument("summary", type=Path)
    p.add_argument("plot", type=Path, nargs="?", default=None)
    args = p.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    print(table(summary["runs"]))
    if args.plot is not None:
        print(f"wrote {plot_ttft(summary, args.plot)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
