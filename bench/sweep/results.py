"""Sweep results: fixed columns, JSON and CSV writers, and the stdout tables.

A row is one (scheme, bandwidth, context, prompt, repeat) run. The column set is
fixed (:data:`COLUMNS`) so downstream tools can rely on it; missing values are
``None`` in JSON and empty in CSV.

Two clocks per run: ``ttft_s`` to the first *tentative* token (for LYNX the first
token drafted on the anchors, which may still be rolled back; for every other
scheme the first token, which is final) and ``ttfct_s`` to the first *committed*
(verified) token. ``first_token_correct``: for a LYNX run, 1.0 when the first
token shown (the first tentative one; the first committed one when nothing was
drafted) equals the first committed token, else 0.0; None for the other schemes,
which show nothing tentative, and for a run that committed nothing. Each LYNX
split is a scheme of its own (``lynx``, ``lynx-3``, ``lynx-2.2.4``, ...; ``planes``
holds its split, ``4,4``, empty for other schemes); :func:`ratio_table` compares
each against the INT8 and INT4 runs of the same sweep.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lynx_bench.sweep.config import is_lynx

__all__ = ["COLUMNS", "Row", "write_results", "read_results", "summary_table", "medians", "means",
           "first_token_correct", "ttft_ratios", "ratio_table", "order_schemes", "CLOCKS_LEGEND", "ACCURACY_LEGEND",
           "crossover_lines"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One sweep run; field order is the CSV column order."""

    scheme: str
    #: the LYNX split as comma-separated widths (``"2,2,4"``); None for other schemes
    planes: str | None
    bandwidth_gbps: float
    context: int
    prompt_id: int
    repeat: int
    #: to the first tentative token
    ttft_s: float
    #: to the first committed token (None when nothing was committed)
    ttfct_s: float | None
    e2e_s: float
    first_token_correct: float | None
    acceptance_rate: float | None
    bytes_anchor: int
    bytes_residual: int
    bytes_total: int
    #: the sweep workload's score (:data:`ACCURACY_LEGEND`)
    accuracy: float | None
    agreement_vs_int8: float | None
    agreement_vs_bf16: float | None
    text: str
    #: the physical limit of this run's first token: anchor-lane bytes at the link rate,
    #: plus one layer and the LM head (from this run's decode step and the measured head)
    physical_limit_s: float | None = None
    #: the prefill node's record of the run (lynx_decode.send_record.SendRecord): its t0 to the
    #: stream's first chunk handed to UCX, and the bytes it holds for the prompt (None: no record)
    first_byte_s: float | None = None
    held_bytes: int | None = None


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Row))
#: the columns every results file has (the ones after them have defaults)
_REQUIRED = sum(1 for f in dataclasses.fields(Row) if f.default is dataclasses.MISSING)


def write_results(out_dir: Path, config: dict[str, Any], rows: Sequence[Row]) -> tuple[Path, Path]:
    """Write ``results.json`` (``{"config": ..., "rows": [...]}``) and ``results.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "results.json", out_dir / "results.csv"
    payload = {"config": config, "rows": [dataclasses.asdict(r) for r in rows]}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow(["" if v is None else v for v in dataclasses.astuple(row)])
    return json_path, csv_path


def read_results(json_path: Path) -> tuple[dict[str, Any], list[Row]]:
    """Read a ``results.json`` back; rejects files whose rows lack the fixed columns
    (the optional trailing ones, added later, may be missing: older files read)."""
    payload = json.loads(json_path.read_text())
    rows = []
    for raw in payload["rows"]:
        if tuple(raw) != COLUMNS[:len(raw)] or len(raw) < _REQUIRED:
            raise ValueError(f"{json_path}: row columns {tuple(raw)} != {COLUMNS}")
        rows.append(Row(**raw))
    return payload["config"], rows


def first_token_correct(scheme: str, first_tentative: int | None, tokens: Sequence[int], *,
                        verified: bool = True) -> float | None:
    """A run's ``first_token_correct`` (module docstring): ``scheme`` is the codec's
    (``lynx`` for every split), ``first_tentative`` the run's first tentative token
    (None when nothing was drafted), ``tokens`` its committed output."""
    if not is_lynx(scheme) or not verified or not tokens:
        return None
    if first_tentative is None:  # the full cache won the race: the first token shown was committed
        return 1.0
    return float(first_tentative == tokens[0])


def _groups(rows: Iterable[Row], field: str) -> dict[tuple[str, float, int], list[float]]:
    groups: dict[tuple[str, float, int], list[float]] = {}
    for row in rows:
        value = getattr(row, field)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        groups.setdefault((row.scheme, row.bandwidth_gbps, row.context), []).append(float(value))
    return groups


def medians(rows: Iterable[Row], field: str) -> dict[tuple[str, float, int], float]:
    """Median of ``field`` per (scheme, bandwidth, context), ignoring missing values."""
    return {key: statistics.median(vals) for key, vals in _groups(rows, field).items()}


def means(rows: Iterable[Row], field: str) -> dict[tuple[str, float, int], float]:
    """Mean of ``field`` per (scheme, bandwidth, context), ignoring missing values
    (for the 0/1 fields: the fraction of runs where it holds)."""
    return {key: statistics.fmean(vals) for key, vals in _groups(rows, field).items()}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: What the tables' clocks and columns mean (``lynx sweep`` prints it under the summary).
CLOCKS_LEGEND = (
    "ttft_s: first tentative token (LYNX: drafted on the anchors, may be rolled back; other schemes: "
    "the first token, final)\n"
    "ttfct_s: first committed (verified) token; e2e_s: last token; MB, accept (acceptance rate): medians\n"
    "fractions of runs: first_ok (LYNX: the first token shown equals the first committed one), "
    "acc (the workload's accuracy, next line), =int8 (equal to INT8 decoding)\n"
    "byte1_ms: the prefill node's t0 to the first byte handed to UCX; held_MB: what it holds for "
    "the prompt (every encoded form): medians"
)

#: What ``accuracy`` scores per sweep workload (``SweepWorkload`` value).
ACCURACY_LEGEND = {
    "passkey": "fraction of runs whose text holds the pass key",
    "generation": "fraction of runs whose tokens all equal the BF16 run's (real text)",
    "fidelity": "teacher-forced top-1 agreement with BF16 over the true continuation (real text)",
}


def order_schemes(schemes: Iterable[str]) -> list[str]:
    """Baselines first (bf16, int8, int4), then every LYNX split in the order given, then the rest."""
    seen = list(dict.fromkeys(schemes))
    base = [s for s in ("bf16", "int8", "int4") if s in seen]
    return base + [s for s in seen if is_lynx(s)] + [s for s in seen if s not in base and not is_lynx(s)]


def _scheme_width(schemes: Iterable[str]) -> int:
    return max([6, *(len(s) for s in schemes)])


def summary_table(rows: Sequence[Row]) -> str:
    """Metrics per (bandwidth, context, scheme) as a fixed-width table: medians of both
    clocks (``ttft_s`` tentative, ``ttfct_s`` committed), ``e2e_s``, size and acceptance;
    means (fractions of runs) of ``first_token_correct`` (LYNX splits), accuracy and
    agreement with INT8. :data:`CLOCKS_LEGEND` explains the columns."""
    med = {f: medians(rows, f) for f in ("ttft_s", "ttfct_s", "e2e_s", "acceptance_rate")}
    # 0/1 per run: the fraction of runs where it holds
    med.update({f: means(rows, f) for f in ("accuracy", "agreement_vs_int8")})
    first_ok = means(rows, "first_token_correct")
    sizes = medians(rows, "bytes_total")
    first_byte, held = medians(rows, "first_byte_s"), medians(rows, "held_bytes")
    order = {s: i for i, s in enumerate(order_schemes(r.scheme for r in rows))}
    keys = sorted({(r.bandwidth_gbps, r.context, r.scheme) for r in rows},
                  key=lambda k: (k[0], k[1], order[k[2]]))
    w = _scheme_width(order)
    header = (f"{'Gbit/s':>7} {'context':>7} {'scheme':<{w}} {'MB':>8} {'ttft_s':>8} "
              f"{'ttfct_s':>8} {'e2e_s':>8} {'accept':>6} {'first_ok':>8} {'acc':>5} {'=int8':>5} "
              f"{'byte1_ms':>8} {'held_MB':>7}")
    lines = [header, "-" * len(header)]
    for bw, ctx, scheme in keys:
        k = (scheme, bw, ctx)
        mb = sizes.get(k)
        lines.append(
            f"{bw:>7g} {ctx:>7d} {scheme:<{w}} {_fmt(None if mb is None else mb / 1e6, '8.2f'):>8} "
            f"{_fmt(med['ttft_s'].get(k), '8.3f'):>8} {_fmt(med['ttfct_s'].get(k), '8.3f'):>8} "
            f"{_fmt(med['e2e_s'].get(k), '8.3f'):>8} {_fmt(med['acceptance_rate'].get(k), '6.2f'):>6} "
            f"{_fmt(first_ok.get(k), '8.2f'):>8} "
            f"{_fmt(med['accuracy'].get(k), '5.2f'):>5} {_fmt(med['agreement_vs_int8'].get(k), '5.2f'):>5} "
            f"{_fmt(_scaled(first_byte.get(k), 1e3), '8.1f'):>8} {_fmt(_scaled(held.get(k), 1e-6), '7.1f'):>7}"
        )
    return "\n".join(lines)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ttft_ratios(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per (bandwidth, context, LYNX split): ratios of medians against the INT8 and
    INT4 runs at the same point, the clocks the paper checks:

    - ``ttft_over_int8``: ``ttft_s(lynx) / ttft_s(int8)``, tentative over INT8's first token;
    - ``ttft_over_int4``: ``ttft_s(lynx) / ttft_s(int4)``, tentative over INT4's first token (target <= 1.05);
    - ``ttfct_over_int8``: ``ttfct_s(lynx) / ttft_s(int8)``, committed over INT8's first token (target <= 1.05);
    - ``e2e_over_int8``: ``e2e_s(lynx) / e2e_s(int8)`` (target <= 1);
    - ``ttft_over_limit``: ``ttft_s(lynx)`` over its physical limit (``physical_limit_s``, target <= 1.1);

    with ``first_token_correct`` (mean) and ``equal_to_int8`` (fraction of the split's
    runs equal to INT8 decoding). A ratio is None when a side is missing."""
    ttft, ttfct, e2e, limit = (medians(rows, f) for f in ("ttft_s", "ttfct_s", "e2e_s", "physical_limit_s"))
    first_ok, agree = means(rows, "first_token_correct"), means(rows, "agreement_vs_int8")
    lynx = [s for s in order_schemes(r.scheme for r in rows) if is_lynx(s)]
    out = []
    for bw, ctx in sorted({(r.bandwidth_gbps, r.context) for r in rows}):
        int8_ttft, int4_ttft = ttft.get(("int8", bw, ctx)), ttft.get(("int4", bw, ctx))
        for scheme in lynx:
            k = (scheme, bw, ctx)
            if k not in ttft:
                continue
            out.append({
                "bandwidth_gbps": bw, "context": ctx, "scheme": scheme,
                "ttft_over_int8": _ratio(ttft[k], int8_ttft),
                "ttft_over_int4": _ratio(ttft[k], int4_ttft),
                "ttfct_over_int8": _ratio(ttfct.get(k), int8_ttft),
                "e2e_over_int8": _ratio(e2e.get(k), e2e.get(("int8", bw, ctx))),
                "ttft_over_limit": _ratio(ttft[k], limit.get(k)),
                "first_token_correct": first_ok.get(k),
                "equal_to_int8": agree.get(k),
            })
    return out


def ratio_table(rows: Sequence[Row]) -> str:
    """:func:`ttft_ratios` as text: one line per (bandwidth, context, LYNX split); the
    header names each ratio's clocks (``lynx clock / baseline clock``)."""
    ratios = ttft_ratios(rows)
    w = _scheme_width(r["scheme"] for r in ratios)
    cols = (("ttft_over_int8", "ttft/int8.ttft", "tentative"), ("ttft_over_int4", "ttft/int4.ttft", "tentative"),
            ("ttfct_over_int8", "ttfct/int8.ttft", "committed"), ("e2e_over_int8", "e2e/int8.e2e", "last"),
            ("ttft_over_limit", "ttft/limit", "tentative"), ("first_token_correct", "first_ok", ""),
            ("equal_to_int8", "=int8", ""))
    widths = [max(9, len(name)) for _, name, _ in cols]
    lead = f"{'':>7} {'':>7} {'lynx clock:':<{w}}"
    lines = [lead + "".join(f" {clock:>{cw}}" for (_, _, clock), cw in zip(cols, widths)).rstrip(),
             f"{'Gbit/s':>7} {'context':>7} {'scheme':<{w}}"
             + "".join(f" {name:>{cw}}" for (_, name, _), cw in zip(cols, widths))]
    lines.append("-" * len(lines[1]))
    for r in ratios:
        lines.append(f"{r['bandwidth_gbps']:>7g} {r['context']:>7d} {r['scheme']:<{w}}"
                     + "".join(f" {_fmt(r[key], f'{cw}.2f'):>{cw}}" for (key, _, _), cw in zip(cols, widths)))
    return "\n".join(lines)


def crossover_lines(rows: Sequence[Row]) -> list[str]:
    """One plain sentence per (context, LYNX split) on what the sweep shows: how much
    sooner than INT8 the first tentative token comes at the slowest and the fastest
    link, and how the first committed token compares (the crossover where splitting
    stops paying is where the first ratio nears 1)."""
    ratios = ttft_ratios(rows)
    out = []
    for ctx, scheme in sorted({(r["context"], r["scheme"]) for r in ratios}, key=lambda k: (k[0], k[1])):
        points = sorted((r for r in ratios if r["context"] == ctx and r["scheme"] == scheme
                         and r["ttft_over_int8"]), key=lambda r: r["bandwidth_gbps"])
        if not points:
            continue
        lo, hi = points[0], points[-1]

        def sooner(r: dict[str, Any]) -> str:
            ratio = r["ttft_over_int8"]
            when = f"{1 / ratio:.2f}x sooner" if ratio <= 1 else f"{ratio:.2f}x later"
            return f"{when} at {r['bandwidth_gbps']:g} Gbit/s"

        committed = [r["ttfct_over_int8"] for r in points if r["ttfct_over_int8"] is not None]
        line = f"{ctx} tokens, {scheme}: the first (tentative) token comes {sooner(lo)}"
        if hi is not lo:
            line += f", {sooner(hi)}"
        line += " than INT8's first token does"
        if committed:
            line += (f"; the first committed token at {min(committed):.2f}-{max(committed):.2f}x "
                     "INT8's first token")
        out.append(line + ".")
    return out
