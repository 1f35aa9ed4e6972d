"""``lynx load``: the KV schemes under load, like vLLM's serving benchmark.

One prefill node (the real ``lynx serve``), ``--decode-nodes`` decode nodes
(separate processes) and open-loop Poisson arrivals: each decode node sends its
requests at their scheduled wall-clock times whatever happened to the earlier
ones, so queueing at the prefill node and on its link is part of every figure.
Every time counts from the moment a decode node sent its request
(``time.time()``; the nodes share the host).

- Offered load (``--load``) is a fraction of the prefill node's egress
  (``--bandwidth``), counted in INT8 bytes per request, so every scheme sees
  the same request rate; or give the rate itself (``--rate``).
- Prefill compute stays out: the requests pick from a fixed set of
  ``--prompts`` prompts (seeded random token ids), each requested once (INT8)
  before the measured phases so its prefill is cached at the prefill node.
- Phases: each (load, scheme) is a separate phase, the schemes of one load on
  the same arrival schedule (seeded). A phase waits until each of its requests
  completed or failed (each bounded by ``--stream-timeout``) before the next
  starts, so phases never overlap; interleaving the schemes instead would make
  each scheme's queueing depend on the others' bytes.
- ``--decode sink`` (:mod:`lynx_bench.load.sink`): the decode nodes receive
  into their pools and record when each request's anchors and its whole cache
  landed, without the model: the transport at load, on a small machine.
  ``--decode model`` (:mod:`lynx_bench.load.decode`): real decoding.
- LYNX's split: ``--planes`` (or ``--anchor-bits B``), by default ``auto``:
  with the sink chosen once per run here (:func:`lynx_bench.load.logic.lynx_split`),
  possibly no split, then the LYNX phases run as INT8 (the table says
  ``lynx int8``); with ``--decode model`` each decode node chooses per request.

Writes ``DIR/load.json`` (:mod:`lynx_bench.load.report`), ``DIR/ttft_cdf.png``,
``DIR/p99_vs_load.png`` and the nodes' logs in ``DIR/logs``; prints a summary
table. Exit code 1 when a request did not complete (the results are still
written), 2 on bad arguments or a node that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lynx_bench.common.node_args import add_timeout_arguments, timeouts
from lynx_bench.common.progress import progress_bar
from lynx_bench.load.launch import RECORDS_FILE, start_nodes
from lynx_bench.load.logic import (
    DecodeMode,
    LoadConfig,
    ModelShape,
    load_for_rate,
    lynx_split,
    poisson_arrivals,
    rate_for_load,
    request_bytes,
    split_label,
)
from lynx_bench.load.phases import Planes, run_phase, warm_up
from lynx_bench.load.report import ratio_table, summary_table, write_load_json
from lynx_bench.load.results import RequestRow, send_record_summary, summarize
from lynx_bench.sweep.config import DEFAULT_PLANES, SCHEMES, LinkMode, parse_floats, parse_planes_flag
from lynx_decode.send_record import read_records
from lynx_decode.split_choice import DEFAULT_STEP_S, NO_SPLIT_STEPS, THREE_BIT_STEPS
from lynx_transport.config import TransportConfig
from lynx_transport.errors import ConfigError
from lynx_transport.protocol.scheduler import LanePolicy

__all__ = ["add_arguments", "config_from_args", "lynx_planes", "scheme_names", "run", "run_load"]

#: Receive pool per decode node: this many of the largest streams; past it streams wait for space.
POOL_STREAMS = 8
MAX_POOL_BYTES = 4 << 30
#: A phase whose peak egress passes this many times --bandwidth gets a warning (a shaper's burst aside).
OVER_RATE = 1.25

PREFILL_NOTE = ("prefill compute stays out: every request picks one of a fixed set of prompts "
                "(seeded random token ids), each requested once as INT8 before the measured phases, "
                "so the prefill node serves cached prefills")
PHASES_NOTE = ("separate phases, one per (load, scheme), in that order; the schemes of one load share "
               "one seeded arrival schedule; a phase ends when each of its requests completed or failed "
               "(each bounded by the request timeout), then the next starts")
#: The splits ``auto`` may choose (:func:`lynx_decode.split_choice.choose_split`); None: INT8.
AUTO_SPLITS: tuple[tuple[int, ...] | None, ...] = (None, (4, 4), (3, 5))

CLOCK_NOTE = ("every time counts from the moment the decode node sent its request (queueing included), "
              "on the wall clock (time.time()) the nodes share")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LoadConfig()
    parser.add_argument("--schemes", metavar="S,...",
                        help=f"KV schemes among {','.join(SCHEMES)} (default all)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--load", metavar="F,...",
                      help="offered loads, fractions of --bandwidth counted in INT8 bytes per request "
                           f"(default {','.join(map(str, d.loads or ()))})")
    rate.add_argument("--rate", metavar="R,...", help="request rates in requests/s (instead of --load)")
    parser.add_argument("--requests", type=int, help=f"requests per phase (default {d.requests})")
    parser.add_argument("--decode-nodes", type=int,
                        help=f"decode nodes, one process each (default {d.decode_nodes})")
    parser.add_argument("--context", type=int, help=f"prompt length in tokens (default {d.context})")
    parser.add_argument("--bandwidth", type=float, metavar="GBPS",
                        help=f"the prefill node's egress in Gbit/s (default {d.bandwidth_gbps:g})")
    parser.add_argument("--link", choices=[m.value for m in LinkMode],
                        help="shaper: the transport's token bucket (default); netns: tc in namespaces (root)")
    parser.add_argument("--decode", choices=[m.value for m in DecodeMode],
                        help="sink: receive and record, no model (default); model: real decoding")
    parser.add_argument("--prompts", type=int, help=f"prompts in the fixed set (default {d.prompts})")
    parser.add_argument("--new-tokens", type=int,
                        help=f"tokens to generate with --decode model (default {d.new_tokens})")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--planes", metavar="W,W[,W]|auto",
                       help="the LYNX split: plane widths from the top bit down, summing to 8 (4,4, 3,5, "
                            "2,2,4); auto (the default): with --decode sink chosen once per run for one "
                            "request's INT8 bytes on --bandwidth and a decode step of "
                            f"{DEFAULT_STEP_S * 1e3:.0f} ms (lynx_decode.split_choice): no split when they "
                            f"cross the link in under {NO_SPLIT_STEPS:g} steps (the lynx phases then run as "
                            f"INT8: 'lynx int8' in the table), 4,4 under {THREE_BIT_STEPS:g}, else 3,5; "
                            "load.json's config says which (lynx_planes) and why (split_choice); with "
                            "--decode model each decode node chooses per request, from the rate seen on its "
                            "earlier streams and its measured decode step (each phase's planes in load.json)")
    split.add_argument("--anchor-bits", type=int, metavar="B",
                       help="the LYNX split B,8-B (instead of --planes)")
    parser.add_argument("--max-pending", type=int, metavar="N",
                        help="the prefill node's admission bound: requests past it get a busy reply "
                             "(lynx serve --max-pending; default its own)")
    parser.add_argument("--hold", dest="hold_residual", action=argparse.BooleanOptionalAction, default=None,
                        help="sink: hold each LYNX residual until every anchor is in (--hold), or ask for it "
                             "with the anchors as a decode node does by default (--no-hold, the default)")
    parser.add_argument("--lane-policy", choices=[p.value for p in LanePolicy],
                        help="the prefill node's order of streams within a lane (lynx serve "
                             "--lane-policy; default its own)")
    parser.add_argument("--seed", type=int, help=f"seed of the arrivals and the prompts (default {d.seed})")
    parser.add_argument("--out", type=Path, help=f"output folder (default {d.out})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print load.json instead of the table")
    add_timeout_arguments(parser, residual=True)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    changes: dict[str, Any] = {}
    if args.schemes is not None:
        changes["schemes"] = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    if args.rate is not None:
        changes["rates_rps"], changes["loads"] = parse_floats(args.rate, "--rate"), None
    elif args.load is not None:
        changes["loads"] = parse_floats(args.load, "--load")
    if args.planes is not None:
        text = args.planes.strip()
        changes["planes"] = "auto" if text == "auto" else parse_planes_flag([text], "--planes")[0]
    for name in ("requests", "decode_nodes", "context", "prompts", "new_tokens", "anchor_bits",
                 "max_pending", "lane_policy", "hold_residual", "seed", "out"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.bandwidth is not None:
        changes["bandwidth_gbps"] = args.bandwidth
    if args.link is not None:
        changes["link"] = LinkMode(args.link)
    if args.decode is not None:
        changes["decode"] = DecodeMode(args.decode)
    changes["timeouts"] = timeouts(args)
    return dataclasses.replace(LoadConfig(), **changes)


def default_model_shape() -> ModelShape:
    """The default model's shape from its GGUF header (milliseconds, no model load)."""
    from lynx_decode.model.gguf_meta import gguf_value  # noqa: PLC0415 - keeps `lynx --help` light
    from lynx_decode.model.store import default_gguf_path  # noqa: PLC0415

    path = default_gguf_path()
    arch = gguf_value(path, "general.architecture")
    heads = int(gguf_value(path, f"{arch}.attention.head_count"))
    return ModelShape(layers=int(gguf_value(path, f"{arch}.block_count")),
                      kv_heads=int(gguf_value(path, f"{arch}.attention.head_count_kv")),
                      head_dim=int(gguf_value(path, f"{arch}.embedding_length")) // heads,
                      vocab=int(gguf_value(path, f"{arch}.vocab_size")),
                      max_positions=int(gguf_value(path, f"{arch}.context_length")))


def _sizes(shape: ModelShape, context: int, planes: tuple[int, ...] | None) -> dict[str, tuple[int, int]]:
    """Every scheme's ``(anchor, residual)`` bytes per request, LYNX's with the split
    ``planes`` (None: LYNX runs as INT8)."""
    return {s: request_bytes(shape, "int8" if s == "lynx" and planes is None else s, context,
                             planes or DEFAULT_PLANES) for s in SCHEMES}


def _pool_bytes(config: LoadConfig, shape: ModelShape, planes: Planes) -> int:
    splits = AUTO_SPLITS if planes == "auto" else (planes,)
    largest = max(sum(_sizes(shape, config.context, p)[s]) for s in config.schemes
                  for p in splits) + (1 << 20)  # + alignment slack
    return max(2 * largest, min(POOL_STREAMS * largest, MAX_POOL_BYTES))


def _plan(config: LoadConfig, int8_bytes: int) -> list[tuple[float, float]]:
    """``(load, rate_rps)`` of every load point."""
    if config.loads is not None:
        return [(load, rate_for_load(load, config.bandwidth_gbps, int8_bytes)) for load in config.loads]
    assert config.rates_rps is not None
    return [(load_for_rate(r, config.bandwidth_gbps, int8_bytes), r) for r in config.rates_rps]


def lynx_planes(config: LoadConfig, int8_bytes: int) -> tuple[Planes, str]:
    """What a run's LYNX requests ask for (a split; None: no split, they run as INT8;
    ``"auto"``: each decode node chooses, ``--decode model``) and why: ``load.json``'s
    ``lynx_planes`` and ``split_choice``. ``int8_bytes``: one request's INT8 stream."""
    split = config.split
    if split != "auto":
        flag = (f"--anchor-bits {config.anchor_bits}" if config.anchor_bits is not None
                else f"--planes {split_label(split)}")
        return split, f"lynx {split_label(split)}: asked for ({flag})"
    if config.decode is DecodeMode.MODEL:
        return "auto", ("--planes auto: chosen per request by each decode node (DecodeNode.run "
                        "planes='auto', lynx_decode.split_choice) from the rate seen on its earlier streams "
                        "and its measured decode step; each lynx phase's planes count the splits it ran")
    choice = lynx_split(config, int8_bytes)
    note = (f"--planes auto chose {choice.reason} (one request's INT8 stream at --bandwidth "
            f"{config.bandwidth_gbps:g} Gbit/s; a sink runs no model: the step is assumed)")
    if choice.planes is None:
        note += "; the lynx phases run as INT8"
    return choice.planes, note


def scheme_names(phases: list[dict[str, Any]], planes: Planes) -> dict[str, str]:
    """What the summary table and the plots call each scheme: LYNX with the splits its
    phases' completed requests ran (``lynx 4,4``, ``lynx int8``, ``lynx 3,5+4,4``),
    else with what its requests asked for."""
    ran = sorted({name for p in phases if p.get("planes") for name in p["planes"]})
    if not ran:
        ran = ["auto" if planes == "auto" else split_label(planes)]
    return {"lynx": "lynx " + "+".join(ran)}


def run_load(config: LoadConfig, shape: ModelShape, *, progress: bool = True, command: str = "",
             ) -> tuple[dict[str, Any], list[RequestRow], list[dict[str, Any]]]:
    """Run every phase; returns the recorded config, the request rows and the phases."""
    logs = config.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    netns = config.link is LinkMode.NETNS
    # the egress is held to --bandwidth by tc (netns) or by `lynx serve --rate`, never per request
    per_request = None
    int8_bytes = sum(request_bytes(shape, "int8", config.context))
    planes, split_note = lynx_planes(config, int8_bytes)
    sizes: dict[str, Any] = {s: {"anchor": a, "residual": r} for s, (a, r)
                             in _sizes(shape, config.context, None if planes == "auto" else planes).items()}
    if planes == "auto":  # each decode node chooses: LYNX's bytes for every split it may choose
        sizes["lynx"] = {split_label(p): dict(zip(("anchor", "residual"), _sizes(shape, config.context, p)["lynx"]))
                         for p in AUTO_SPLITS}
    pool_bytes = _pool_bytes(config, shape, planes)
    plan = _plan(config, int8_bytes)
    n_warm = config.prompts + max(0, config.decode_nodes - config.prompts) + len(config.schemes)
    bar = progress_bar(n_warm + len(plan) * len(config.schemes) * config.requests, disable=not progress, unit="req")
    recorded: dict[str, Any] = {
        "command": command, **config.to_json(), "started_unix": time.time(),
        "model": dataclasses.asdict(shape), "bytes_int8_per_request": int8_bytes,
        "bytes_per_request": sizes,
        "lynx_planes": planes if planes is None or planes == "auto" else list(planes),
        "split_choice": split_note,
        "points": [{"load": load, "rate_rps": rate} for load, rate in plan],
        "prefill": PREFILL_NOTE, "phases": PHASES_NOTE, "clock": CLOCK_NOTE,
        "arrivals": "open-loop Poisson, seeded: one sequence of exponential gaps scaled by 1/rate; "
                    "request i goes to decode node i % decode_nodes and picks a seeded random prompt",
        "egress": (f"tc htb at {config.bandwidth_gbps:g} Gbit/s on the prefill namespace's one veth "
                   "(bench/netem/link.py, one namespace per decode node on a bridge)" if netns else
                   f"lynx serve --rate {config.bandwidth_gbps:g}: one rate for all decode nodes"),
        "lane_policy": config.lane_policy or TransportConfig().lane_policy.value,
        "decode_pool_bytes": pool_bytes,
    }
    rows: list[RequestRow] = []
    phases: list[dict[str, Any]] = []
    try:
        bar.phase(f"starting the prefill node and {config.decode_nodes} decode nodes")
        with start_nodes(config, shape, logs, pool_bytes) as nodes:
            bar.phase(f"warm-up: {config.prompts} prefills of {config.context} tokens, every node and scheme")
            recorded["warm_up"] = warm_up(nodes, config, shape, None, planes, bar)
            number = 0
            for load, rate in plan:
                arrivals = poisson_arrivals(rate, config.requests, config.seed,
                                            decode_nodes=config.decode_nodes, prompts=config.prompts)
                for scheme in config.schemes:
                    name = scheme_names([], planes).get(scheme, scheme)
                    bar.phase(f"{name} load {load:.2f} ({rate:.2f} req/s)")
                    got, info = run_phase(nodes, config, number, scheme, load, rate, arrivals, per_request,
                                       planes, bar)
                    rows += got
                    phases.append(info)
                    number += 1
    finally:
        bar.close()
    recorded["finished_unix"] = time.time()
    recorded["send_records"] = send_record_summary(read_records(logs / RECORDS_FILE).values())
    return recorded, rows, phases


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the run like Ctrl-C (``KeyboardInterrupt``), so the nodes are stopped."""
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    shape = default_model_shape()
    config.validate(max_context=shape.max_positions)
    if config.link is LinkMode.NETNS and os.geteuid() != 0:
        raise ConfigError("--link netns needs root (network namespaces and tc); "
                          "use --link shaper (the default) to shape in the transport instead")
    if config.decode is DecodeMode.MODEL:
        from lynx_bench.load import decode as load_decode  # noqa: PLC0415 - fails early if the model path is missing

        load_decode.check_available()
    command = shlex.join(["lynx", *sys.argv[1:]]) if sys.argv[0].endswith("lynx") else shlex.join(sys.argv)
    with _terminate_as_interrupt():
        recorded, rows, phases = run_load(config, shape, progress=not args.no_progress, command=command)
    summary = summarize(rows, config.bandwidth_gbps)
    json_path = write_load_json(config.out / "load.json", recorded, rows, summary, phases)
    from lynx_bench.load.plots import plot_p99_vs_load, plot_ttft_cdf  # noqa: PLC0415 - matplotlib

    names = scheme_names(phases, recorded["lynx_planes"])
    cdf_png = plot_ttft_cdf(rows, config.out / "ttft_cdf.png", names)
    p99_png = plot_p99_vs_load(summary, config.out / "p99_vs_load.png", names)
    if args.json:
        print(json_path.read_text())
    else:
        print(summary_table(summary, names))
        if "lynx" in config.schemes and len(config.schemes) > 1:
            print()
            print("p99 ratios (Lynx against the INT8 and INT4 baselines, same run):")
            print(ratio_table(summary))
        print()
    for scheme, sent in recorded["send_records"].items():
        first, held = sent["first_byte_p50_s"], sent["held_bytes_p50"]
        print(f"prefill node, {scheme}: {sent['requests']} sent, first byte on the wire "
              f"{'-' if first is None else f'{first * 1e3:.1f} ms'} after t0 (p50), "
              f"{'-' if held is None else f'{held / 1e6:.1f} MB'} held per prompt",
              file=sys.stderr if args.json else sys.stdout)
    if "lynx" in config.schemes and config.split == "auto":
        print(f"lynx: {recorded['split_choice']}", file=sys.stderr if args.json else sys.stdout)
    for path in (json_path, cdf_png, p99_png):
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    fast = [p for p in phases if (p["peak_egress_gbps"] or 0) > OVER_RATE * config.bandwidth_gbps]
    if fast:
        worst = max(p["peak_egress_gbps"] for p in fast)
        print(f"lynx load: warning: in {len(fast)} phases the link carried more than --bandwidth "
              f"{config.bandwidth_gbps:g} Gbit/s (up to {worst:.2f}, phases' peak_egress_gbps in "
              f"{json_path}): the prefill node's egress was not held to one rate for all decode nodes",
              file=sys.stderr)
    missing = sum(s.failed for s in summary)
    if missing:
        print(f"lynx load: {missing} of {len(rows)} requests did not complete (see status in {json_path})",
              file=sys.stderr)
        return 1
    return 0
