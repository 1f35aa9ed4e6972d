"""``lynx accuracy``: the accuracy half of the claim, per workload, context and scheme.

::

    lynx accuracy --workloads fidelity,generation,retrieval --contexts 2048,4096 \\
        --schemes bf16,int8,int4,lynx --cases 10 --out DIR [--ttft-from SWEEP_DIR]

Writes ``DIR/accuracy.json`` (:mod:`lynx_bench.accuracy.report`) and ``DIR/accuracy.png``
(bars per scheme with standard errors, per workload; with ``--ttft-from`` a sweep's
``results.json`` adds the accuracy-vs-TTFT scatter), prints a table (``--json``:
the JSON). Every bad argument is refused before the model loads; a context longer
than the texts on the machine before the first prefill. Exit code 1 when a LYNX
split's committed output is not INT8's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from lynx_transport.errors import ConfigError

from ..common.node_args import add_model_arguments, load_model
from ..common.progress import progress_bar
from ..sweep.config import SCHEMES, scheme_flag_changes
from ..sweep.results import Row, read_results
from .config import AccuracyConfig, Workload, parse_workloads
from .report import check_corpus, lynx_mismatches, run_accuracy, summary_table, total_cases, write_report
from .texts import LICENSES, load_corpus

__all__ = ["add_arguments", "run", "config_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AccuracyConfig()
    parser.add_argument("--workloads", metavar="W,...",
                        help=f"among {','.join(w.value for w in Workload)} (default all)")
    parser.add_argument("--contexts", metavar="N,...",
                        help=f"prompt lengths in tokens (default {','.join(map(str, d.contexts))})")
    parser.add_argument("--schemes", metavar="S,...", help=f"KV schemes among {','.join(SCHEMES)} (default all)")
    splits = parser.add_mutually_exclusive_group()
    splits.add_argument("--anchor-bits", metavar="B,...",
                        help="LYNX anchor widths, each the split B,8-B, reported as lynx-B (default: 4, named lynx)")
    splits.add_argument("--planes", nargs="+", metavar="W,W[,W...]",
                        help="LYNX splits, plane widths from the top bit down (e.g. 4,4 2,2,4)")
    parser.add_argument("--cases", type=int, metavar="N", help=f"cases per workload and context (default {d.cases})")
    parser.add_argument("--fidelity-tokens", type=int, metavar="N",
                        help=f"teacher-forced tokens per fidelity case (default {d.fidelity_tokens})")
    parser.add_argument("--generation-tokens", type=int, metavar="N",
                        help=f"greedy tokens per generation case (default {d.generation_tokens})")
    parser.add_argument("--answer-tokens", type=int, metavar="N",
                        help=f"greedy tokens per retrieval answer (default {d.answer_tokens})")
    parser.add_argument("--seed", type=int, metavar="N",
                        help=f"seed of the text windows and needles (default {d.seed})")
    parser.add_argument("--texts", metavar="NAME,...",
                        help="documents: files of /usr/share/common-licenses or pydoc (default "
                             f"{','.join(d.texts)}; filler prose when none can be read)")
    parser.add_argument("--out", type=Path, help=f"output folder (default {d.out})")
    parser.add_argument("--ttft-from", type=Path, metavar="SWEEP_DIR",
                        help="a `lynx sweep` output folder: adds accuracy against its median ttft_s to accuracy.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print accuracy.json instead of the table")
    add_model_arguments(parser)


def config_from_args(args: argparse.Namespace) -> AccuracyConfig:
    changes = scheme_flag_changes(args)
    if args.workloads is not None:
        changes["workloads"] = parse_workloads(args.workloads)
    if args.texts is not None:
        changes["texts"] = tuple(t.strip() for t in args.texts.split(",") if t.strip())
    for name in ("cases", "fidelity_tokens", "generation_tokens", "answer_tokens", "seed", "out"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return AccuracyConfig(**changes)


def _window_of(model: str | None) -> int | None:
    """The context window from a GGUF header (the default model's when ``model`` is None);
    None for a transformers directory (checked once it is loaded)."""
    from lynx_decode.errors import ModelError  # noqa: PLC0415 - only the CLI needs the model store
    from lynx_decode.model.gguf_meta import gguf_context_length  # noqa: PLC0415
    from lynx_decode.model.store import default_gguf_path  # noqa: PLC0415

    if model is not None and Path(model).suffix != ".gguf":
        return None
    try:
        return gguf_context_length(default_gguf_path() if model is None else Path(model))
    except ModelError:
        return None  # not installed: loading reports it with the install hint


def _check_texts(names: tuple[str, ...] | None) -> None:
    """Texts asked for by name must exist (only the default list falls back to prose)."""
    for name in names or ():
        if name != "pydoc" and not (LICENSES / name).is_file():
            raise ConfigError(f"--texts: no text {name!r}: give files of {os.fspath(LICENSES)} or pydoc")


def _sweep_rows(folder: Path | None) -> list[Row] | None:
    if folder is None:
        return None
    path = folder / "results.json"
    try:
        _, rows = read_results(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--ttft-from: cannot read a sweep's results from {os.fspath(path)!r}: {exc}") from None
    if not rows:
        raise ConfigError(f"--ttft-from: {os.fspath(path)!r} has no runs")
    return rows


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args).validate(max_context=_window_of(args.model))
    _check_texts(None if args.texts is None else config.texts)
    sweep_rows = _sweep_rows(args.ttft_from)
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    started = time.perf_counter()
    model = load_model(args)
    config.validate(max_context=model.info.max_positions)
    corpus = load_corpus(model.tokenize, config.texts)
    check_corpus(config, corpus)
    bar = progress_bar(total_cases(config), disable=args.no_progress, unit="case")

    def on_case(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update()

    try:
        rows = run_accuracy(model, config, corpus, on_case=on_case)
    finally:
        bar.close()
    command = shlex.join(["lynx", *sys.argv[1:]]) if sys.argv[0].endswith("lynx") else shlex.join(sys.argv)
    recorded = {"command": command, **config.to_json(), "model_id": model.info.model_id,
                "corpus": corpus.source, "documents": {k: len(v) for k, v in corpus.documents.items()},
                "ttft_from": None if args.ttft_from is None else str(args.ttft_from),
                "run_s": round(time.perf_counter() - started, 1), "finished_unix": time.time()}
    json_path = write_report(config.out, recorded, rows)
    from .plots import plot_accuracy_report  # noqa: PLC0415 - matplotlib, the bench extra

    png = plot_accuracy_report(rows, config.out / "accuracy.png", sweep_rows=sweep_rows)
    if args.json:
        print(json_path.read_text())
    else:
        print(summary_table(rows))
        print()
    for path in (json_path, png):
        print(f"wrote {path}")
    bad = lynx_mismatches(rows)
    for scheme, n in bad.items():
        print(f"lynx: {scheme}: {n} cases differ from INT8", file=sys.stderr)
    return 1 if bad else 0
