"""Sweep results: fixed columns, JSON and CSV writers, and the stdout table.

A row is one (scheme, bandwidth, context, prompt, repeat) run. The column set is
fixed (:data:`COLUMNS`) so downstream tools can rely on it; missing values are
``None`` in JSON and empty in CSV.
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

__all__ = ["COLUMNS", "Row", "write_results", "read_results", "summary_table", "medians",
           "ttft_ratios", "ratio_table"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One sweep run; field order is the CSV column order."""

    scheme: str
    bandwidth_gbps: float
    context: int
    prompt_id: int
    repeat: int
    ttft_s: float
    ttfct_s: float
    e2e_s: float
    acceptance_rate: float | None
    bytes_anchor: int
    bytes_residual: int
    bytes_total: int
    accuracy: float | None
    agreement_vs_int8: float | None
    agreement_vs_bf16: float | None
    text: str


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Row))


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
    """Read a ``results.json`` back; rejects files whose rows lack the fixed columns."""
    payload = json.loads(json_path.read_text())
    rows = []
    for raw in payload["rows"]:
        if tuple(raw) != COLUMNS:
            raise ValueError(f"{json_path}: row columns {tuple(raw)} != {COLUMNS}")
        rows.append(Row(**raw))
    return payload["config"], rows


def medians(rows: Iterable[Row], field: str) -> dict[tuple[str, float, int], float]:
    """Median of ``field`` per (scheme, bandwidth, context), ignoring missing values."""
    groups: dict[tuple[str, float, int], list[float]] = {}
    for row in rows:
        value = getattr(row, field)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        groups.setdefault((row.scheme, row.bandwidth_gbps, row.context), []).append(float(value))
    return {key: statistics.median(vals) for key, vals in groups.items()}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(rows: Sequence[Row]) -> str:
    """Median metrics per (bandwidth, context, scheme) as a fixed-width table."""
    fields = ("ttft_s", "ttfct_s", "e2e_s", "acceptance_rate", "accuracy", "agreement_vs_int8")
    med = {f: medians(rows, f) for f in fields}
    sizes = medians(rows, "bytes_total")
    keys = sorted({(r.bandwidth_gbps, r.context, r.scheme) for r in rows})
    header = (f"{'Gbit/s':>7} {'context':>7} {'scheme':<6} {'MB':>8} {'ttft_s':>8} "
              f"{'ttfct_s':>8} {'e2e_s':>8} {'accept':>6} {'acc':>5} {'=int8':>5}")
    lines = [header, "-" * len(header)]
    for bw, ctx, scheme in keys:
        k = (scheme, bw, ctx)
        mb = sizes.get(k)
        lines.append(
            f"{bw:>7g} {ctx:>7d} {scheme:<6} {_fmt(None if mb is None else mb / 1e6, '8.2f'):>8} "
            f"{_fmt(med['ttft_s'].get(k), '8.3f'):>8} {_fmt(med['ttfct_s'].get(k), '8.3f'):>8} "
            f"{_fmt(med['e2e_s'].get(k), '8.3f'):>8} {_fmt(med['acceptance_rate'].get(k), '6.2f'):>6} "
            f"{_fmt(med['accuracy'].get(k), '5.2f'):>5} {_fmt(med['agreement_vs_int8'].get(k), '5.2f'):>5}"
        )
    return "\n".join(lines)


def ttft_ratios(rows: Sequence[Row]) -> list[dict[str, float | int | None]]:
    """Per (bandwidth, context): median ``ttft_s(int8) / ttft_s(lynx)`` (the paper's
    speed-up over 8-bit) and ``ttft_s(lynx) / ttft_s(int4)`` (closeness to 4-bit),
    with the fraction of Lynx runs equal to INT8 decoding."""
    med = medians(rows, "ttft_s")
    out = []
    for bw, ctx in sorted({(r.bandwidth_gbps, r.context) for r in rows}):
        lynx, int8, int4 = (med.get((s, bw, ctx)) for s in ("lynx", "int8", "int4"))
        agree = [r.agreement_vs_int8 for r in rows
                 if r.scheme == "lynx" and r.bandwidth_gbps == bw and r.context == ctx
                 and r.agreement_vs_int8 is not None]
        out.append({
            "bandwidth_gbps": bw, "context": ctx,
            "int8_over_lynx": int8 / lynx if int8 and lynx else None,
            "lynx_over_int4": lynx / int4 if lynx and int4 else None,
            "lynx_equal_to_int8": sum(agree) / len(agree) if agree else None,
        })
    return out


def ratio_table(rows: Sequence[Row]) -> str:
    """:func:`ttft_ratios` as text."""
    lines = [f"{'Gbit/s':>7} {'context':>7} {'int8/lynx':>9} {'lynx/int4':>9} {'lynx=int8':>9}"]
    for r in ttft_ratios(rows):
        lines.append(f"{r['bandwidth_gbps']:>7g} {r['context']:>7d} "
                     f"{_fmt(r['int8_over_lynx'], '9.2f'):>9} {_fmt(r['lynx_over_int4'], '9.2f'):>9} "
                     f"{_fmt(r['lynx_equal_to_int8'], '9.2f'):>9}")
    return "\n".join(lines)
