"""``make vllm-bench``: vLLM's own serving benchmark (``vllm bench serve``, through
:mod:`lynx_bench.vllm.bench_client`) against disaggregated configurations, from the vLLM
environment (``make vllm-env``)::

    python -m lynx_bench.vllm.bench --out vllm-bench-out [--prompt-tokens 2048] [--requests 20]
        [--rate R|auto] [--configs none,lynx-bf16,lynx-int8,lynx-lynx,nixl] [--links 0.5,unshaped]

Configurations (every server a ``vllm.entrypoints.openai.api_server`` process, one thread, on cores
of its own as if on a node of its own: the producer or plain server the first half of this
process's cores, the consumer the rest; ``--no-pin`` leaves them to the scheduler):
``none``, one plain vLLM server; ``lynx-<scheme>[-async]``, a LynxConnector producer and
consumer with Lynx's proxy (``python -m lynx_vllm.proxy --scheme <scheme>``) in front (the
configurations of one load mode share the two servers; only the proxy is restarted);
``nixl``, vLLM's NixlConnector (``kv_both``, CPU buffers, :data:`NIXL_EXTRA`, UCX as
:func:`nixl_env` sets it) pair behind the same proxy, which follows vLLM's
P/D convention (the prefill leg gets ``do_remote_decode: true``, the decode leg the prefill
answer's ``kv_transfer_params`` as they came), when ``import nixl`` works in the vLLM environment
(``make vllm-env`` installs ``nixl``); otherwise its row records the exact error and the run
goes on.

Links: ``unshaped`` (loopback, every process in this namespace), or a rate in Gbit/s: a
``lynx link up --hosts 2`` link (prefix ``lynxvb``) at that rate, the producer in its ``tx``
namespace, the consumer in ``rx0``, the proxy and the benchmark client in ``rx1`` (the bridge
reaches both; this process's own requests go from a thread inside ``rx1``), UCX pinned to tcp on
each namespace's veth, and Lynx's own shaper off: Lynx and NIXL cross the same tc-shaped link. The
link is torn down after its runs, on errors and on Ctrl-C. ``none`` (no transfer) runs once,
unshaped. Each row of ``summary.json`` says how its link was shaped (``link_shaping``).

The workload is vLLM's ``random`` dataset: seeded prompts of ``--prompt-tokens`` tokens, 16
output tokens (greedy, EOS ignored), Poisson arrivals at ``--rate``, ``--requests`` requests.
``--rate auto`` is 0.7 x the producer's prefill throughput, from one prefill of the prompt length
(``max_tokens`` 1) timed on the first producer before the runs (with ``auto`` the P/D
configurations run before ``none``; with ``none`` alone, on its plain server).

Writes ``OUT/summary.json`` (:mod:`lynx_bench.vllm.bench_summary`), ``OUT/breakdown.json``
(where each run's TTFT goes, what ran beside each decode, its request throughput and the load
averages), ``OUT/ttft.png``,
each run's vLLM result and the proxy's and the consumer's records under ``OUT/runs``, and every
server's log under ``OUT/logs``; prints a table, and one progress line per phase on stderr.
Every wait is bounded; every process (each in a session of its own) is ended on exit, an error,
SIGTERM or Ctrl-C.

This module runs the matrix (configuration groups by link) and writes the results; the server
processes and where they run are :mod:`~lynx_bench.vllm.bench_servers`, the session (command
lines, requests), each group's servers, its link and the rate :mod:`~lynx_bench.vllm.bench_session`,
an asynchronous configuration's unloaded TPOT :mod:`~lynx_bench.vllm.bench_unloaded`, the rows and
the table :mod:`~lynx_bench.vllm.bench_summary`, and what the proxy's and the consumer's records
say :mod:`~lynx_bench.vllm.bench_records`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lynx_bench.common.errors import LinkError, VllmNodeError
from lynx_bench.common.stats import percentile
from lynx_bench.vllm.bench_records import (
    decode_overlaps,
    pulled,
    shaping_error,
    ttft_breakdown,
    wire_gbps,
)
from lynx_bench.vllm.bench_servers import Server, wait_ready
from lynx_bench.vllm.bench_session import (
    LINK_PREFIX,
    NIXL_EXTRA,
    OUTPUT_TOKENS,
    Bench,
    Rate,
    nixl_error,
    placed,
    say,
    start_group,
)
from lynx_bench.vllm.bench_summary import (
    BenchConfig,
    Connector,
    failed_row,
    fill_equal_to_int8,
    parse_configs,
    parse_links,
    parse_rate,
    plot_ttft,
    rate_rule,
    run_row,
    table,
)
from lynx_bench.vllm.bench_unloaded import BESIDE_SEED, UNLOADED_REQUESTS, UNLOADED_SEED, unloaded_tpot
from lynx_bench.vllm.driver import INSTALL_HINT, REPO_ROOT, vllm_python

__all__ = ["main", "run"]

ROOT = REPO_ROOT
DEFAULT_CONFIGS = "none,lynx-bf16,lynx-int8,lynx-lynx,nixl"
#: The default run's links: 0.5 Gbit/s through tc, then loopback.
DEFAULT_LINKS = "0.5,unshaped"


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _link_name(link: float | None) -> str:
    return "unshaped" if link is None else f"{link:g}G"


def _groups(configs: Sequence[BenchConfig], *, producer_first: bool) -> list[list[BenchConfig]]:
    """The configurations by the servers they need, in order of first appearance (``producer_first``:
    those with a producer before ``none``, so ``--rate auto`` times a producer's prefill)."""
    out: dict[tuple[Connector, str | None], list[BenchConfig]] = {}
    for c in configs:
        out.setdefault(c.backend, []).append(c)
    groups = list(out.values())
    if producer_first:
        groups.sort(key=lambda g: g[0].connector is Connector.NONE)
    return groups


class _Results:
    """What the runs left: the summary's rows, each row's generated texts (None where a request
    failed, the whole entry None where the configuration did not run), the errors, and each run's
    breakdown (``breakdown.json``)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.texts: list[list[str | None] | None] = []
        self.errors: list[dict[str, Any]] = []
        self.details: dict[str, Any] = {}

    def skip(self, group: Sequence[BenchConfig], link: float | None, rate: float | None, requests: int,
             why: str) -> None:
        """Configurations that did not run: a failed row and an error each."""
        for c in group:
            say(f"{c.name} @ {_link_name(link)}: not run: {why}")
            self.rows.append(failed_row(c, link, rate, requests))
            self.texts.append(None)
            self.errors.append({"config": c.name, "link_gbps": link, "error": why})


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); the summary it wrote."""
    python = vllm_python() or Path(sys.executable)
    if importlib.util.find_spec("vllm") is None and vllm_python() is None:
        raise VllmNodeError(f"no vLLM environment: {INSTALL_HINT}")
    out: Path = args.out
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not (out / ".gitignore").exists():  # results, not sources (as pytest's and ruff's caches do)
        (out / ".gitignore").write_text("*\n")
    bench = Bench(args, python)
    rate = Rate(args.rate)
    results = _Results()
    loadavg_start = os.getloadavg()
    nixl_why = nixl_error(python) if any(c.connector is Connector.NIXL for c in args.configs) else None
    try:
        for i, link in enumerate(args.links):
            for group in _groups(args.configs, producer_first=args.rate is None):
                connector = group[0].connector
                if connector is Connector.NONE and i > 0:
                    continue  # no transfer: one run, unshaped
                row_link = None if connector is Connector.NONE else link
                if connector is Connector.NIXL and nixl_why is not None:
                    results.skip(group, row_link, rate.value, args.requests, nixl_why)
                    continue
                _run_group(bench, group, row_link, rate, results)
    finally:
        bench.close()
    fill_equal_to_int8(results.rows, results.texts)
    summary = {"config": _summary_config(bench, rate, loadavg_start, results.errors), "runs": results.rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "breakdown.json").write_text(json.dumps(results.details, indent=2) + "\n")
    _plot(summary, out)
    return summary


def _run_group(bench: Bench, group: list[BenchConfig], link: float | None, rate: Rate, results: _Results) -> None:
    """One configuration group at ``link``: its servers, a warm-up, the rate, then each configuration's
    run; a :class:`VllmNodeError` or :class:`LinkError` marks the configurations not yet run as failed."""
    tag = f"{group[0].connector.value}{'-async' if group[0].load == 'async' else ''}-{_link_name(link)}"
    done = 0
    try:
        with placed(bench, link):
            prefill, consumer = start_group(bench, group, link, tag)
            say(f"{tag}: warm-up on {prefill.name}")
            bench.complete(prefill.url, bench.prompt_ids(64, 7), 2, f"warmup.{tag}")
            request_rate = rate.ensure(bench, prefill)
            for c in group:
                name = f"{c.name}-{_link_name(link)}"
                row, proxy = _measure(bench, c, link, tag, prefill, consumer, request_rate, results)
                done += 1
                for server in (prefill, consumer):  # one that died mid-run says why in the summary
                    if server is not None and server.proc.poll() is not None:
                        results.errors.append({"config": c.name, "link_gbps": link,
                                               "error": f"{server.name} exited with {server.proc.returncode} "
                                                        f"during the run; the end of its log ({server.log}):\n"
                                                        f"{server.tail(8)}"})
                say(f"{name}: {row['completed']} completed, {row['failed']} failed, TTFT p50 "
                    f"{row['ttft_ms']['median'] or 0:.0f} ms")
                if proxy is not None:
                    bench.stop(proxy)
    except (VllmNodeError, LinkError) as exc:
        say(f"{tag}: failed: {exc}")
        results.skip(group[done:], link, rate.value, bench.args.requests, str(exc))
    finally:
        bench.close()


def _measure(bench: Bench, c: BenchConfig, link: float | None, tag: str, prefill: Server, consumer: Server | None,
             request_rate: float, results: _Results) -> tuple[dict[str, Any], Server | None]:
    """One configuration's run (its proxy started in front of ``consumer`` when there is one, two
    warm-ups, ``vllm bench serve``), recorded in ``results``; its row and its proxy (still running)."""
    args = bench.args
    name = f"{c.name}-{_link_name(link)}"
    run_dir = bench.out / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    proxy = None
    stats = run_dir / "proxy-requests.jsonl"
    stats.unlink(missing_ok=True)
    endpoint, align = prefill, prefill
    if consumer is not None:
        proxy = bench.proxy(f"{name}-proxy", prefill, consumer, c.scheme, stats)
        wait_ready([proxy, prefill, consumer], 120.0)  # a dead server: its log at once
        endpoint, align = proxy, consumer
    say(f"{name}: warm-up through {endpoint.name} (2 short requests)")
    for k in range(2):
        bench.complete(endpoint.url, bench.prompt_ids(64 + k, 11 + k), 2, f"warmup.{name}.{k}")
    unloaded = unloaded_tpot(bench, c, name, endpoint, align, prefill, request_rate, run_dir)
    prefix = f"{name}-"
    say(f"{name}: vllm bench serve, {args.requests} requests of {args.prompt_tokens} tokens at "
        f"{request_rate:.4f}/s (Poisson, seed {args.seed})")
    before = os.getloadavg()
    started = time.monotonic()
    result = bench.benchmark(endpoint.url, align.url, request_rate, prefix, run_dir)
    records = _records(stats) if proxy is not None else None
    loads = _records(bench.out / "runs" / f"{tag}-consumer-loads.jsonl")
    row = run_row(c, link, request_rate, args.requests, result, records, prefix, tpot_unloaded=unloaded,
                  pulled=pulled(records or [], loads, prefix))
    results.rows.append(row)
    errs = result.get("errors") or []
    results.texts.append([None if (k < len(errs) and errs[k]) else t
                          for k, t in enumerate(result.get("generated_texts") or [])])
    results.details[name] = {"duration_s": result.get("duration"),
                             "request_throughput": result.get("request_throughput"),
                             "wall_s": time.monotonic() - started, "loadavg_before": before,
                             "loadavg_after": os.getloadavg(),
                             "errors": sorted({str(e)[:300] for e in errs if e}),
                             "ttft_breakdown_ms": ttft_breakdown(records or [], loads, prefix)}
    results.details[name]["decode_overlaps"] = decode_overlaps(records or [], loads, prefix)
    rates = wire_gbps(records or [], loads, prefix)
    results.details[name]["wire_gbps"] = {"median": percentile(rates, 50), "n": len(rates)}
    why = shaping_error(link, rates)
    if why is not None:
        say(f"{name}: NOT SHAPED: {why}")
        results.errors.append({"config": c.name, "link_gbps": link, "error": f"not shaped: {why}"})
    return row, proxy


def _summary_config(bench: Bench, rate: Rate, loadavg_start: tuple[float, float, float],
                    errors: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``config``: the command, the workload, the configurations and links, the
    servers' dtype and cores, the host."""
    args = bench.args
    return {"command": shlex.join([sys.executable, "-m", "lynx_bench.vllm.bench", *args.argv]),
            "seed": args.seed, "prompt_tokens": args.prompt_tokens, "output_tokens": OUTPUT_TOKENS,
            "requests": args.requests, "rate": rate.value,
            "rate_rule": rate_rule(args.rate, rate.prefill_s, args.prompt_tokens, rate.measured_on),
            "arrivals": "Poisson (vLLM's --request-rate, --burstiness 1)",
            "dataset": "vLLM's random dataset, --random-range-ratio 0, greedy (--temperature 0), "
                       "EOS ignored",
            "configs": [c.name for c in args.configs],
            "links": [_link_name(g) for g in args.links],
            "link_note": "unshaped: loopback; a number: tc htb on a `lynx link up --hosts 2` "
                         f"link ({LINK_PREFIX}: producer tx, consumer rx0, proxy and client rx1), "
                         "UCX tcp on the veths, Lynx's own shaper off",
            "nixl": {"kv_connector_extra_config": NIXL_EXTRA,
                     "ucx": "unshaped: UCX's own choice; shaped: the link's ucx_env (tcp, veth)"},
            "model": str(args.model), "servers": "vllm.entrypoints.openai.api_server, one thread each "
                                                 "(OMP_NUM_THREADS=1), VLLM_CPU_KVCACHE_SPACE=1",
            "dtype": bench.dtype, "server_cpus": bench.cpus,
            "consumer_ttft": "proxy decode_sent_at -> decode_first_byte_at (the decode leg's first "
                             "streamed token)",
            "tpot_unloaded": f"async configurations: {UNLOADED_REQUESTS} requests one at a time (vLLM's "
                             f"--max-concurrency 1) through the same proxy before the measured run, seed "
                             f"{args.seed + UNLOADED_SEED}; idle: nothing else running; beside_prefills: the "
                             "producer prefilling other prompts of the same length (one-token completions sent "
                             f"to it directly, seed {args.seed + BESIDE_SEED} on) at the run's rate meanwhile",
            "commit": _commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
            "errors": errors}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _plot(summary: dict[str, Any], out: Path) -> None:
    """``OUT/ttft.png``: here when matplotlib is, else from Lynx's main environment (the vLLM one has none)."""
    path = out / "ttft.png"
    if importlib.util.find_spec("matplotlib") is not None:
        plot_ttft(summary, path)
        say(f"wrote {path}")
        return
    main_python = ROOT / ".venv" / "bin" / "python"
    if not main_python.is_file():
        say(f"no plot: matplotlib is not here and there is no {main_python} (make install)")
        return
    try:
        done = subprocess.run([str(main_python), "-m", "lynx_bench.vllm.bench_summary", str(out / "summary.json"),
                               str(path)], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        say("no plot: the plotting process did not end within 180 s")
        return
    say(f"wrote {path}" if done.returncode == 0 else f"no plot: {done.stderr.strip()[-300:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The runner's settings (exits with the reason when they are bad)."""
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m lynx_bench.vllm.bench",
                                description="vLLM's own serving benchmark (vllm bench serve) against P/D "
                                            "configurations, from the vLLM environment (make vllm-env).",
                                epilog="\n\n".join(paragraphs[2:5]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("vllm-bench-out"))
    p.add_argument("--model", type=Path, default=None, help="a transformers directory (default: Lynx's default model)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="every prompt's length (default %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="requests per configuration (default %(default)s)")
    p.add_argument("--rate", type=parse_rate, default=None, metavar="R|auto",
                   help="requests per second (Poisson); auto (default): 0.7 x the producer's prefill throughput, "
                        "from one prefill of the prompt length timed before the runs")
    p.add_argument("--configs", type=parse_configs, default=parse_configs(DEFAULT_CONFIGS), metavar="C,C",
                   help=f"none, nixl, lynx-<bf16|int8|int4|lynx>[-async] (default {DEFAULT_CONFIGS})")
    p.add_argument("--links", type=parse_links, default=parse_links(DEFAULT_LINKS), metavar="L,L",
                   help="unshaped (loopback) and/or rates in Gbit/s, each held by tc on a `lynx link up --hosts 2` "
                        f"namespace link that both connectors cross (needs root; default {DEFAULT_LINKS})")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (default %(default)s)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="the servers' dtype (default auto: bfloat16 where the CPU computes in it, AVX-512 BF16 or "
                        "AMX, else float32)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the servers to the scheduler (default: producer and consumer each on cores of "
                        "their own, as on two nodes)")
    args = p.parse_args(argv)
    if args.prompt_tokens < 16:
        p.error(f"--prompt-tokens must be at least 16, got {args.prompt_tokens}")
    if args.requests < 1:
        p.error(f"--requests must be at least 1, got {args.requests}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _signals() -> Iterator[None]:
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from lynx_decode.model.store import converted_model_dir, default_gguf_path  # noqa: PLC0415 - model extra

        args.model = converted_model_dir(default_gguf_path())
    started = time.monotonic()
    try:
        with _signals():
            summary = run(args)
    except KeyboardInterrupt:
        say("interrupted: every server stopped")
        return 130
    except VllmNodeError as exc:
        say(str(exc))
        return 1
    print(table(summary["runs"]))
    say(f"wrote {args.out / 'summary.json'} in {time.monotonic() - started:.0f} s")
    bad = [r for r in summary["runs"] if r["failed"] and r["connector"] != "nixl"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
