"""``lynx load``'s report: ``load.json`` (written atomically, read back with its fixed
fields checked) and the summary and ratio tables the command prints.

Pure formatting and files; the rows come from :mod:`lynx_bench.load.results`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lynx_bench.load.results import REQUEST_FIELDS, SUMMARY_FIELDS, RequestRow, SummaryRow

__all__ = ["write_load_json", "read_load_json", "summary_table", "ratio_table"]


def write_load_json(path: Path, config: dict[str, Any], rows: Sequence[RequestRow],
                    summary: Sequence[SummaryRow], phases: Sequence[dict[str, Any]] = ()) -> Path:
    """Write ``{"config", "requests", "summary", "phases"}`` to ``path`` (atomically)."""
    payload = {"config": config, "requests": [dataclasses.asdict(r) for r in rows],
               "summary": [dataclasses.asdict(s) for s in summary], "phases": list(phases)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_load_json(path: Path) -> tuple[dict[str, Any], list[RequestRow], list[SummaryRow]]:
    """Read ``load.json`` back; ``ValueError`` when a row lacks the fixed fields."""
    payload = json.loads(Path(path).read_text())
    rows, summary = [], []
    for raw in payload["requests"]:
        if tuple(raw) != REQUEST_FIELDS:
            raise ValueError(f"{path}: request fields {tuple(raw)} != {REQUEST_FIELDS}")
        rows.append(RequestRow(**raw))
    for raw in payload["summary"]:
        if tuple(raw) != SUMMARY_FIELDS:
            raise ValueError(f"{path}: summary fields {tuple(raw)} != {SUMMARY_FIELDS}")
        summary.append(SummaryRow(**raw))
    return payload["config"], rows, summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(summary: Sequence[SummaryRow], names: Mapping[str, str] | None = None) -> str:
    """The summary as a fixed-width table, by load then scheme (in the given order);
    ``names``: what a scheme is called in it (e.g. ``{"lynx": "lynx int8"}``)."""
    names = names or {}
    shown = {s.scheme: names.get(s.scheme, s.scheme) for s in summary}
    width = max([6, *map(len, shown.values())])
    header = (f"{'load':>5} {'scheme':<{width}} {'done':>9} {'p50_ttft':>9} {'p90_ttft':>9} {'p99_ttft':>9} "
              f"{'p50_ttfct':>9} {'p99_ttfct':>9} {'p99_full':>9} {'link':>5}")
    lines = [header, "-" * len(header)]
    loads = sorted({s.load for s in summary})
    for load in loads:
        for s in (s for s in summary if s.load == load):
            lines.append(
                f"{s.load:>5.2f} {shown[s.scheme]:<{width}} {f'{s.completed}/{s.requests}':>9} "
                f"{_fmt(s.p50_ttft_s, '9.3f')} {_fmt(s.p90_ttft_s, '9.3f')} {_fmt(s.p99_ttft_s, '9.3f')} "
                f"{_fmt(s.p50_ttfct_s, '9.3f')} {_fmt(s.p99_ttfct_s, '9.3f')} {_fmt(s.p99_full_s, '9.3f')} "
                f"{_fmt(s.link_utilization, '5.2f')}")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratio_table(summary: Sequence[SummaryRow]) -> str:
    """Per load: LYNX's p99 first-token and full-cache times against INT8's and INT4's."""
    by = {(s.scheme, s.load): s for s in summary}
    lines = [f"{'load':>5} {'p99_ttft lynx/int8':>18} {'p99_ttft lynx/int4':>18} {'p99_full lynx/int8':>18}"]
    for load in sorted({s.load for s in summary}):
        lynx, int8, int4 = (by.get((name, load)) for name in ("lynx", "int8", "int4"))
        if lynx is None:
            continue
        lines.append(f"{load:>5.2f} "
                     f"{_fmt(_ratio(lynx.p99_ttft_s, int8.p99_ttft_s if int8 else None), '18.2f')} "
                     f"{_fmt(_ratio(lynx.p99_ttft_s, int4.p99_ttft_s if int4 else None), '18.2f')} "
                     f"{_fmt(_ratio(lynx.p99_full_s, int8.p99_full_s if int8 else None), '18.2f')}")
    return "\n".join(lines)
