"""``lynx sweep``: time-to-first-token against link bandwidth, per KV scheme.

For each bandwidth x context x prompt x repeat x scheme, the decode node (a
worker process, :mod:`lynx_bench.sweep.worker`) asks the prefill node (a
``lynx serve`` process) for a prompt's cache through lynx_transport,
with the link held to the bandwidth either by the sender's token-bucket shaper
(``--link shaper``, default, no root) or by tc in two network namespaces
(``--link netns``, root; one link per bandwidth). Results: ``DIR/results.json``,
``DIR/results.csv`` (fixed columns, :mod:`lynx_bench.sweep.results`), the plots
``DIR/ttft_vs_bandwidth.png`` and ``DIR/accuracy.png``, a table on stdout, and
``DIR/runs.jsonl``: one line per run (reference runs included) with the job and
every metric the decode node reported (lane transfer times, ``draft_ready_s``,
``first_tentative_s``, ``dequant_s``, tokens, ...), written as runs finish.

Schemes: ``--schemes`` picks among bf16, int8, int4 and lynx; lynx runs once per
LYNX split (``--anchor-bits 4,3`` or ``--planes 4,4 2,2,4``), each split a scheme of
its own, ``lynx-4``, ``lynx-3``, ``lynx-2.2.4`` (just ``lynx`` for the default split
alone; :func:`lynx_bench.sweep.config.lynx_scheme_name`). Every scheme, each split
included, runs interleaved with the others at every point.

Workloads (``--workload``, :class:`~lynx_bench.sweep.config.SweepWorkload`): the
prompts and the ``accuracy`` column. ``fidelity`` (default): windows of real
text, ``accuracy`` the teacher-forced top-1 agreement with BF16 over the text's
next 256 tokens (:func:`lynx_bench.accuracy.report.fidelity_scores`, computed in this
process after the timed runs; INT4 visibly loses there, LYNX does not);
``generation``: the same windows, ``accuracy`` 1.0 when a run's tokens equal the
BF16 run's; ``passkey``: pass-key prompts, ``accuracy`` the key found (1.0 for
every scheme on the default model).

``agreement_vs_int8`` / ``agreement_vs_bf16``: 1.0 when a run's tokens equal the
INT8 / BF16 run's tokens for the same prompt (decoded unshaped when that scheme
is not part of the sweep). Every LYNX split must equal INT8 decoding: the exit
code is 1 when a run of one does not. ``first_token_correct``: see
:mod:`lynx_bench.sweep.results`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lynx_bench.common.node_args import add_timeout_arguments, timeout_argv, timeouts
from lynx_bench.common.processes import Child, ChildError
from lynx_bench.common.progress import progress_bar
from lynx_bench.sweep.config import (
    QUICK,
    SCHEMES,
    TEXT_CONTINUATION,
    LinkMode,
    SweepConfig,
    SweepScheme,
    SweepWorkload,
    is_lynx,
    parse_floats,
    scheme_flag_changes,
)
from lynx_bench.sweep.results import (
    ACCURACY_LEGEND,
    CLOCKS_LEGEND,
    Row,
    crossover_lines,
    first_token_correct,
    ratio_table,
    summary_table,
    write_results,
)
from lynx_transport.errors import ConfigError

__all__ = ["add_arguments", "run", "run_sweep"]

STARTUP_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 300.0
#: how long a run waits for its prefill node's record after its decode node answered
RECORD_WAIT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SweepConfig()
    parser.add_argument("--bandwidths", metavar="GBPS,...",
                        help=f"link rates in Gbit/s (default {','.join(map(str, d.bandwidths_gbps))})")
    parser.add_argument("--contexts", metavar="N,...",
                        help=f"prompt lengths in tokens (default {','.join(map(str, d.contexts))})")
    parser.add_argument("--schemes", metavar="S,...",
                        help=f"KV schemes among {','.join(SCHEMES)} (default all)")
    parser.add_argument("--prompts", type=int, help=f"pass-key prompts per context (default {d.prompts})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens to generate (default {d.new_tokens})")
    splits = parser.add_mutually_exclusive_group()
    splits.add_argument("--anchor-bits", metavar="B,...",
                        help="LYNX anchor widths, each the split B,8-B, run side by side as schemes "
                             f"lynx-B (default {d.splits[0][0]}; the default split alone is named lynx)")
    splits.add_argument("--planes", nargs="+", metavar="W,W[,W...]",
                        help="LYNX splits, plane widths from the top bit down summing to 8 (e.g. 4,4 "
                             "2,2,4), run side by side as schemes lynx-4, lynx-2.2.4 "
                             f"(default {','.join(map(str, d.splits[0]))}; the default split alone is named lynx)")
    parser.add_argument("--link", choices=[m.value for m in LinkMode],
                        help="shaper: the transport's token bucket (default); netns: tc in namespaces (root)")
    parser.add_argument("--workload", choices=[w.value for w in SweepWorkload],
                        help="prompts and accuracy: fidelity (real text, teacher-forced top-1 agreement with "
                             "BF16), generation (real text, tokens equal to BF16's) or passkey "
                             f"(default {d.workload.value})")
    parser.add_argument("--repeats", type=int, help=f"repeats per point (default {d.repeats})")
    parser.add_argument("--seed", type=int, help=f"seed of the prompts (default {d.seed})")
    parser.add_argument("--out", type=Path, help=f"output folder (default {d.out})")
    parser.add_argument("--quick", action="store_true",
                        help="the demo preset (0.5, 1, 2, 5, 10 Gbit/s, 4096 tokens, 1 prompt, 16 tokens, 1 repeat)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    add_timeout_arguments(parser, residual=True)


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    base = QUICK if args.quick else SweepConfig()
    changes = scheme_flag_changes(args)
    if args.bandwidths is not None:
        changes["bandwidths_gbps"] = parse_floats(args.bandwidths, "--bandwidths")
    for name in ("prompts", "new_tokens", "repeats", "seed", "out"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.link is not None:
        changes["link"] = LinkMode(args.link)
    if args.workload is not None:
        changes["workload"] = SweepWorkload(args.workload)
    changes["timeouts"] = timeouts(args)
    if ("planes" in changes or "anchor_bits" in changes) and "schemes" not in changes \
            and "lynx" not in base.schemes:
        # splits asked for on a preset that names its LYNX schemes (--quick: lynx-auto, lynx-4):
        # they replace those
        changes["schemes"] = (*(s for s in base.schemes if not is_lynx(s)), "lynx")
    if args.quick and args.out is None:
        changes["out"] = Path("demo-out")
    return dataclasses.replace(base, **changes).validate()


@dataclasses.dataclass(frozen=True)
class _Job:
    bandwidth_gbps: float | None
    context: int
    prompt_id: int
    repeat: int
    #: the scheme's name in the results (``lynx-3``, ``int8``, ...)
    scheme: str
    #: the codec scheme the decode node asks for (``lynx`` for every split)
    codec_scheme: str
    #: the LYNX split (None for other schemes, and for ``auto``)
    planes: tuple[int, ...] | None = None
    recorded: bool = True
    #: ``lynx-auto``: the decode node chooses the split
    auto: bool = False


def _jobs(config: SweepConfig, bandwidths: tuple[float, ...]) -> list[_Job]:
    jobs = []
    schemes: tuple[SweepScheme, ...] = config.sweep_schemes
    for ctx in config.contexts:
        for prompt in range(config.prompts):
            for ref in ("int8", "bf16"):
                if ref not in config.schemes:
                    jobs.append(_Job(None, ctx, prompt, 0, ref, ref, recorded=False))
            for repeat in range(config.repeats):
                for bw in bandwidths:
                    for s in schemes:
                        jobs.append(_Job(bw, ctx, prompt, repeat, s.name, s.scheme, s.planes, auto=s.auto))
    return jobs


def _request(config: SweepConfig, job: _Job) -> dict[str, Any]:
    """The worker's job line for ``job`` (see :mod:`lynx_bench.sweep.worker`)."""
    return {"context": job.context, "prompt_id": job.prompt_id, "seed": config.seed,
            "scheme": job.codec_scheme,
            "planes": "auto" if job.auto else None if job.planes is None else list(job.planes),
            "bandwidth_gbps": job.bandwidth_gbps, "new_tokens": config.new_tokens,
            "workload": config.workload.value}


def _planes_text(job: _Job, out: dict[str, Any]) -> str | None:
    """The split a run used: the job's, or for ``lynx-auto`` the one the decode node
    chose (``int8`` when it chose none)."""
    if not job.auto:
        return None if job.planes is None else ",".join(map(str, job.planes))
    chosen = out.get("planes")
    return "int8" if chosen is None else ",".join(map(str, chosen))


def _python() -> list[str]:
    return [sys.executable]


@contextlib.contextmanager
def _nodes(config: SweepConfig, bandwidth: float | None,
           logs: Path) -> Iterator[tuple[Child, dict[str, Any], Path]]:
    """Start the prefill node and the decode worker (in namespaces for netns); yields
    the worker, its READY facts and the prefill node's records file."""
    link = None
    serve_env: dict[str, str] = {}
    worker_env: dict[str, str] = {}
    listen, listen_host = "127.0.0.1:0", "127.0.0.1"
    serve_ucx: list[str] = []
    worker_ucx: list[str] = []
    if config.link is LinkMode.NETNS:
        from lynx_bench.netem.config import LinkConfig  # noqa: PLC0415
        from lynx_bench.netem.link import Link  # noqa: PLC0415

        assert bandwidth is not None
        # A prefix of our own, so a link someone left up by hand does not collide.
        link = Link(LinkConfig(rate_gbps=bandwidth, prefix=f"lxs{os.getpid() % 100000}")).up()
        serve_env, worker_env = link.ucx_env("tx"), link.ucx_env("rx")
        listen, listen_host = f"{link.address('tx')}:0", link.address("rx")
        # pin UCX to tcp on each namespace's veth: left to itself it moves the bytes by
        # cma between the two processes of this host and bypasses tc (see add_ucx_arguments)
        serve_ucx = ["--ucx-tls", "tcp", "--ucx-net-devices", link.device("tx")]
        worker_ucx = ["--ucx-tls", "tcp", "--ucx-net-devices", link.device("rx")]
    serve = worker = None
    try:
        tag = "" if bandwidth is None else f"-{bandwidth:g}"
        records = logs / f"serve{tag}-records.jsonl"
        records.unlink(missing_ok=True)
        argv = [*_python(), "-m", "lynx_bench.cli", "serve", "--listen", listen, "--records", str(records),
                *timeout_argv(config.timeouts), *serve_ucx]
        serve = Child("prefill node", argv if link is None else link.exec_argv("tx", argv),
                      logs / f"serve{tag}.log", env=serve_env)
        address = serve.expect("listening on", STARTUP_TIMEOUT_S)
        argv = [*_python(), "-m", "lynx_bench.sweep.worker", "--connect", address,
                "--listen-host", listen_host, "--prompts", str(config.prompts),
                *timeout_argv(config.timeouts, residual=True), *worker_ucx]
        worker = Child("decode node", argv if link is None else link.exec_argv("rx", argv),
                       logs / f"decode{tag}.log", env=worker_env)
        ready = json.loads(worker.expect("READY", STARTUP_TIMEOUT_S))
        yield worker, ready, records
    finally:
        for child in (worker, serve):
            if child is not None:
                child.stop()
        if link is not None:
            link.down()



def run_sweep(config: SweepConfig, *, progress: bool = True, command: str = "") -> tuple[list[Row], dict[str, Any]]:
    """Run the sweep; returns the rows and the recorded config."""
    from lynx_decode.send_record import wait_record  # noqa: PLC0415 - loads the decode stack

    logs = config.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    groups: list[tuple[float | None, tuple[float, ...]]]
    if config.link is LinkMode.NETNS:
        groups = [(bw, (bw,)) for bw in config.bandwidths_gbps]
    else:
        groups = [(None, config.bandwidths_gbps)]
    all_jobs = [(g, _jobs(config, bws) if i == 0 else [j for j in _jobs(config, bws) if j.recorded])
                for i, (g, bws) in enumerate(groups)]
    total = sum(len(jobs) for _, jobs in all_jobs)
    bar = progress_bar(total, disable=not progress, unit="run")
    results: list[tuple[_Job, dict[str, Any]]] = []
    model_id = None
    runs = (config.out / "runs.jsonl").open("w", encoding="utf-8")
    prefilled: set[tuple[int, int]] = set()  # (context, prompt): the prefill node holds its prefill
    try:
        for group_bw, jobs in all_jobs:
            link = "" if group_bw is None else f" behind a {group_bw:g} Gbit/s link"
            bar.phase(f"starting the prefill and decode nodes{link} (model load, kernels)")
            with _nodes(config, group_bw, logs) as (worker, ready, records):
                model_id = ready["model_id"]
                config.validate(max_context=int(ready["max_positions"]))
                for job in jobs:
                    label = f"{job.scheme} {job.bandwidth_gbps or 'ref'} Gbit/s ctx {job.context}"
                    first = (job.context, job.prompt_id) not in prefilled
                    prefilled.add((job.context, job.prompt_id))
                    bar.phase(f"prefill of {job.context} tokens, then {label}" if first else label)
                    worker.send(json.dumps(_request(config, job)))
                    out = json.loads(worker.expect("RESULT", RUN_TIMEOUT_S))
                    if "error" in out:
                        raise ChildError(f"run {job} failed: {out['error']}")
                    out["send_record"] = wait_record(records, out["request_id"], RECORD_WAIT_S)
                    results.append((job, out))
                    runs.write(json.dumps({"job": dataclasses.asdict(job), **out}) + "\n")
                    runs.flush()
                    bar.update(timed=job.recorded and not first)  # a prefill's time says nothing of a run's
    finally:
        runs.close()
        bar.close()
    rows = _rows(results, config.workload)
    recorded = {"command": command, **config.to_json(), "model_id": model_id,
                "finished_unix": time.time()}
    return rows, recorded


def _rows(results: list[tuple[_Job, dict[str, Any]]], workload: SweepWorkload = SweepWorkload.PASSKEY) -> list[Row]:
    """The recorded runs as rows; ``accuracy`` is the worker's (pass key found) or, for
    ``generation``, the run's agreement with the BF16 run (``fidelity``: filled in
    later by :func:`_with_fidelity`, None until then)."""
    refs: dict[tuple[str, int, int], list[int]] = {}
    for job, out in results:
        if job.scheme in ("int8", "bf16") and job.repeat == 0:
            refs.setdefault((job.scheme, job.context, job.prompt_id), out["tokens"])

    def agree(ref: str, job: _Job, tokens: list[int]) -> float | None:
        ref_tokens = refs.get((ref, job.context, job.prompt_id))
        return None if ref_tokens is None else float(ref_tokens == tokens)

    rows = []
    for job, out in results:
        if not job.recorded:
            continue
        assert job.bandwidth_gbps is not None
        rows.append(Row(
            scheme=job.scheme, planes=_planes_text(job, out),
            bandwidth_gbps=job.bandwidth_gbps, context=job.context,
            prompt_id=job.prompt_id, repeat=job.repeat, ttft_s=out["ttft_s"],
            ttfct_s=out["ttfct_s"], e2e_s=out["e2e_s"],
            first_token_correct=first_token_correct(job.codec_scheme, out.get("first_tentative_token"),
                                                    out["tokens"], verified=out.get("verified", True)),
            acceptance_rate=out["acceptance_rate"],
            bytes_anchor=out["bytes_anchor"], bytes_residual=out["bytes_residual"],
            bytes_total=out["bytes_total"],
            accuracy=agree("bf16", job, out["tokens"]) if workload is SweepWorkload.GENERATION else out["accuracy"],
            agreement_vs_int8=agree("int8", job, out["tokens"]), agreement_vs_bf16=agree("bf16", job, out["tokens"]),
            text=out["text"], physical_limit_s=out.get("physical_limit_s"),
            first_byte_s=(out.get("send_record") or {}).get("first_byte_s"),
            held_bytes=(out.get("send_record") or {}).get("held_bytes")))
    return rows


def _with_fidelity(config: SweepConfig, rows: list[Row], *, progress: bool) -> list[Row]:
    """``rows`` with ``accuracy`` the teacher-forced top-1 agreement with BF16 of each
    run's scheme on its prompt (one model in this process, after the nodes stopped)."""
    from lynx_bench.accuracy.report import fidelity_scores  # noqa: PLC0415 - loads the model's code
    from lynx_bench.accuracy.texts import load_corpus  # noqa: PLC0415
    from lynx_decode.model import CausalLM, HFCausalLM  # noqa: PLC0415

    # HFCausalLM.forward takes its own SlabCache, narrower than the protocol's LMCache
    model = typing.cast(CausalLM, HFCausalLM.load())
    schemes = config.sweep_schemes
    bar = progress_bar(len(config.contexts) * config.prompts, disable=not progress, unit="prompt")

    def step(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update()

    try:
        scores = fidelity_scores(model, load_corpus(model.tokenize), config.contexts, config.prompts, config.seed,
                                 schemes, TEXT_CONTINUATION, on_case=step)
    finally:
        bar.close()
    return [dataclasses.replace(r, accuracy=scores[(r.scheme, r.context, r.prompt_id)]) for r in rows]


def _convert_model_here() -> None:
    """The default model's one-time conversion, in this process (where its progress
    lines show) rather than in a node process whose output goes to a log file."""
    from lynx_decode.errors import ModelError  # noqa: PLC0415
    from lynx_decode.model.store import converted_model_dir, default_gguf_path  # noqa: PLC0415

    try:
        converted_model_dir(default_gguf_path())
    except ModelError:
        pass  # not installed: the decode worker reports it with the install hint


def _default_context_window() -> int | None:
    """The default model's context window, read from its GGUF header (milliseconds);
    None when the model is not installed (the decode worker then reports it)."""
    from lynx_decode.errors import ModelError  # noqa: PLC0415
    from lynx_decode.model.gguf_meta import gguf_context_length  # noqa: PLC0415
    from lynx_decode.model.store import default_gguf_path  # noqa: PLC0415

    try:
        return gguf_context_length(default_gguf_path())
    except ModelError:
        return None


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    config.validate(max_context=_default_context_window())
    if config.link is LinkMode.NETNS and os.geteuid() != 0:
        raise ConfigError("--link netns needs root (network namespaces and tc); "
                          "use --link shaper (the default) to shape in the transport instead")
    command = shlex.join(["lynx", *sys.argv[1:]]) if sys.argv[0].endswith("lynx") else shlex.join(sys.argv)
    _convert_model_here()
    rows, recorded = run_sweep(config, progress=not args.no_progress, command=command)
    if config.workload is SweepWorkload.FIDELITY:
        rows = _with_fidelity(config, rows, progress=not args.no_progress)
    json_path, csv_path = write_results(config.out, recorded, rows)
    from lynx_bench.sweep.plots import plot_accuracy, plot_ttft_vs_bandwidth  # noqa: PLC0415

    ttft_png = plot_ttft_vs_bandwidth(rows, config.out / "ttft_vs_bandwidth.png")
    acc_png = plot_accuracy(rows, config.out / "accuracy.png", workload=config.workload.value)
    if args.json:
        print(json_path.read_text())
    else:
        print(summary_table(rows))
        print(CLOCKS_LEGEND)
        print(f"acc ({config.workload.value}): {ACCURACY_LEGEND[config.workload.value]}")
        print()
        print("median ratios per LYNX split against the INT8 and INT4 baselines, same run:")
        print(ratio_table(rows))
        print()
        for line in crossover_lines(rows):
            print(line)
        print()
    for path in (json_path, csv_path, ttft_png, acc_png):
        print(f"wrote {path}")
    bad: dict[str, int] = {}
    for r in rows:
        if is_lynx(r.scheme) and r.agreement_vs_int8 != 1.0:
            bad[r.scheme] = bad.get(r.scheme, 0) + 1
    for scheme, n in bad.items():
        print(f"lynx: {scheme}: {n} runs differ from INT8 decoding", file=sys.stderr)
    return 1 if bad else 0
