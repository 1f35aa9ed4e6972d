"""The accuracy report: workloads where a 4-bit KV cache visibly loses and LYNX does not.

:func:`run_accuracy` runs every (context, case) of the configured workloads
(:mod:`lynx_bench.accuracy.config`) on the model, each scheme's cache through
the real codec (:mod:`lynx_bench.accuracy.eval`), and returns one
:class:`AccuracyRow` per (workload, context, scheme, case, metric).
:func:`summarize` gives per (workload, context, scheme, metric) the mean over
the cases and its standard error. :func:`write_report` writes ``accuracy.json``::

    {"config": {...},
     "rows": [{"workload", "context", "scheme", "case", "metric", "value"}, ...],
     "summary": [{"workload", "context", "scheme", "metric", "mean", "stderr", "cases"}, ...]}

The fidelity and generation workloads read the same text windows (case ``i`` of
one is case ``i`` of the other, one prefill for both); retrieval builds its own
prompts. ``lynx accuracy`` (:mod:`lynx_bench.accuracy.cli`) is the command line;
``lynx sweep --workload fidelity`` uses :func:`fidelity_scores` for its accuracy.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lynx_decode.model import CausalLM

from ..sweep.config import SweepScheme
from ..sweep.results import order_schemes
from .config import METRICS, AccuracyConfig, Workload
from .eval import Scored, evaluate_retrieval, evaluate_text
from .retrieval import retrieval_cases
from .scores import mean_stderr
from .texts import Corpus, TextWindow, text_windows

__all__ = ["AccuracyRow", "SummaryRow", "ROW_FIELDS", "SUMMARY_FIELDS", "check_corpus", "total_cases",
           "run_accuracy", "fidelity_scores", "summarize", "write_report", "read_report", "summary_table",
           "lynx_mismatches"]


@dataclasses.dataclass(frozen=True)
class AccuracyRow:
    """One metric of one scheme on one case."""

    workload: str
    context: int
    scheme: str
    case: int
    metric: str
    value: float


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One metric of one scheme at one context: mean over ``cases``, its standard error
    (None for a single case)."""

    workload: str
    context: int
    scheme: str
    metric: str
    mean: float
    stderr: float | None
    cases: int


ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AccuracyRow))
SUMMARY_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SummaryRow))


def check_corpus(config: AccuracyConfig, corpus: Corpus) -> None:
    """Raise :class:`ConfigError` when a context (plus what is scored after it) is longer
    than every text of ``corpus``: before any prefill."""
    for ctx in config.contexts:
        if any(w is not Workload.RETRIEVAL for w in config.workloads):
            text_windows(corpus, ctx, config.continuation, 1, config.seed)
        if Workload.RETRIEVAL in config.workloads:
            text_windows(corpus, ctx, 0, 1, config.seed)


def total_cases(config: AccuracyConfig) -> int:
    """Prefills :func:`run_accuracy` makes (its progress callback's total)."""
    text = any(w is not Workload.RETRIEVAL for w in config.workloads)
    per = int(text) + int(Workload.RETRIEVAL in config.workloads)
    return per * config.cases * len(config.contexts)


def _rows(workload: Workload, context: int, case: int, scored: Iterable[Scored]) -> list[AccuracyRow]:
    return [AccuracyRow(workload.value, context, s.scheme, case, s.metric, s.value) for s in scored]


def run_accuracy(model: CausalLM, config: AccuracyConfig, corpus: Corpus, *,
                 on_case: Callable[[str], None] | None = None) -> list[AccuracyRow]:
    """Every row of the report; ``on_case(label)`` after each prefilled case."""
    schemes = config.sweep_schemes
    fidelity = config.fidelity_tokens if Workload.FIDELITY in config.workloads else None
    generation = config.generation_tokens if Workload.GENERATION in config.workloads else None
    rows: list[AccuracyRow] = []
    for ctx in config.contexts:
        if fidelity or generation:
            windows: list[TextWindow] = text_windows(corpus, ctx, config.continuation, config.cases, config.seed)
            for i, window in enumerate(windows):
                fid, gen = evaluate_text(model, window.ids, ctx, schemes, fidelity=fidelity, generation=generation)
                rows += _rows(Workload.FIDELITY, ctx, i, fid) + _rows(Workload.GENERATION, ctx, i, gen)
                if on_case is not None:
                    on_case(f"text ctx {ctx} case {i} ({window.document})")
        if Workload.RETRIEVAL in config.workloads:
            for i, case in enumerate(retrieval_cases(model.tokenize, corpus, ctx, config.cases, config.seed)):
                rows += _rows(Workload.RETRIEVAL, ctx, i, evaluate_retrieval(model, case, schemes,
                                                                            config.answer_tokens))
                if on_case is not None:
                    on_case(f"retrieval ctx {ctx} case {i} ({case.kind.value})")
    return rows


def fidelity_scores(model: CausalLM, corpus: Corpus, contexts: Sequence[int], prompts: int, seed: int,
                    schemes: Sequence[SweepScheme], tokens: int,
                    on_case: Callable[[str], None] | None = None) -> dict[tuple[str, int, int], float]:
    """``top1_agreement_vs_bf16`` per (scheme, context, prompt) on the text windows
    ``text_windows(corpus, context, tokens, prompts, seed)``, teacher-forced over
    ``tokens`` tokens: the accuracy ``lynx sweep --workload fidelity`` reports."""
    out = {}
    for ctx in contexts:
        for i, window in enumerate(text_windows(corpus, ctx, tokens, prompts, seed)):
            fid, _ = evaluate_text(model, window.ids, ctx, schemes, fidelity=tokens, generation=None)
            out.update({(s.scheme, ctx, i): s.value for s in fid if s.metric == "top1_agreement_vs_bf16"})
            if on_case is not None:
                on_case(f"fidelity ctx {ctx} prompt {i}")
    return out


def summarize(rows: Sequence[AccuracyRow]) -> list[SummaryRow]:
    """Mean and standard error per (workload, context, scheme, metric), in report order:
    workloads and metrics as :data:`METRICS` lists them, contexts ascending, baselines first."""
    groups: dict[tuple[str, int, str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.context, r.scheme, r.metric), []).append(r.value)
    workload_order = {w.value: i for i, w in enumerate(Workload)}
    metric_order = {(w.value, m): i for w, ms in METRICS.items() for i, m in enumerate(ms)}
    scheme_order = {s: i for i, s in enumerate(order_schemes(r.scheme for r in rows))}
    def rank(key: tuple[str, int, str, str]) -> tuple[int, int, int, int]:
        workload, ctx, scheme, metric = key
        return workload_order.get(workload, 99), ctx, metric_order.get((workload, metric), 99), scheme_order[scheme]

    out = []
    for (workload, ctx, scheme, metric), vals in sorted(groups.items(), key=lambda kv: rank(kv[0])):
        mean, stderr = mean_stderr(vals)
        out.append(SummaryRow(workload, ctx, scheme, metric, mean, stderr, len(vals)))
    return out


def write_report(out_dir: Path, config: dict[str, Any], rows: Sequence[AccuracyRow]) -> Path:
    """Write ``out_dir/accuracy.json`` (module docstring); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "accuracy.json"
    payload = {"config": config, "rows": [dataclasses.asdict(r) for r in rows],
               "summary": [dataclasses.asdict(s) for s in summarize(rows)]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def read_report(path: Path) -> tuple[dict[str, Any], list[AccuracyRow]]:
    """Read an ``accuracy.json`` back; rejects rows without exactly :data:`ROW_FIELDS`."""
    payload = json.loads(path.read_text())
    rows = []
    for raw in payload["rows"]:
        if tuple(raw) != ROW_FIELDS:
            raise ValueError(f"{path}: row fields {tuple(raw)} != {ROW_FIELDS}")
        rows.append(AccuracyRow(**raw))
    return payload["config"], rows


def lynx_mismatches(rows: Iterable[AccuracyRow]) -> dict[str, int]:
    """Per LYNX scheme, how many cases failed ``equal_to_int8``."""
    bad: dict[str, int] = {}
    for r in rows:
        if r.metric == "equal_to_int8" and r.value != 1.0:
            bad[r.scheme] = bad.get(r.scheme, 0) + 1
    return bad


def _cell(s: SummaryRow) -> str:
    spec = ".2e" if s.metric.startswith("kl") else ".3f"
    err = "" if s.stderr is None else f" ±{s.stderr:{spec}}"
    return f"{s.mean:{spec}}{err}"


def summary_table(rows: Sequence[AccuracyRow]) -> str:
    """The summary as text: per workload and metric one line per context, a column
    per scheme (mean ± standard error over the cases)."""
    summary = summarize(rows)
    schemes = order_schemes(s.scheme for s in summary)
    width = max(16, *(len(_cell(s)) + 1 for s in summary)) if summary else 16
    lines = []
    keys = list(dict.fromkeys((s.workload, s.metric) for s in summary))
    for workload, metric in keys:
        cells = {(s.context, s.scheme): s for s in summary if s.workload == workload and s.metric == metric}
        cases = max(s.cases for s in cells.values())
        lines += ["", f"{workload}: {metric} (mean ± stderr over {cases} cases)",
                  f"{'context':>8}" + "".join(f"{name:>{width}}" for name in schemes)]
        for ctx in sorted({c for c, _ in cells}):
            lines.append(f"{ctx:>8}" + "".join(
                f"{_cell(cells[(ctx, name)]) if (ctx, name) in cells else '-':>{width}}" for name in schemes))
    return "\n".join(lines).lstrip("\n")
