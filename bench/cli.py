"""The ``lynx`` command: one entry point, one subcommand per module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Subcommand modules import their heavy dependencies (ucxx, torch, matplotlib)
inside ``run``, so ``lynx --help`` stays fast and an optional extra that is not
installed only affects its own subcommand (with an install hint).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from lynx_transport.errors import LynxError

__all__ = ["main", "SUBCOMMANDS", "SHOWN_AT_INFO", "configure_logging"]

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("lynx_bench.info", "show versions and which backends are available"),
    "link": ("lynx_bench.netem.cli", "emulated network link: two namespaces, veth, tc shaping"),
    "passkey": ("lynx_bench.accuracy.passkey", "pass-key accuracy of the full-precision model per context and depth"),
    "accuracy": ("lynx_bench.accuracy.cli",
                 "accuracy per KV scheme: fidelity, generation and retrieval against BF16, with plots"),
    "serve": ("lynx_bench.nodes.serve", "run a prefill node: prefill prompts and stream their KV caches"),
    "sweep": ("lynx_bench.sweep.cli", "TTFT against link bandwidth for bf16/int8/int4/lynx, with plots"),
    "load": ("lynx_bench.load.cli",
             "serving under load: open-loop Poisson requests from many decode nodes, tail TTFT per scheme"),
    "generate": ("lynx_bench.nodes.generate", "run a decode node: fetch a prompt's KV cache and generate"),
    "bench-transport": ("lynx_bench.transport_bench.cli",
                        "transport throughput and latency vs raw ucxx, ucx_perftest, asyncio TCP, NIXL and "
                        "Mooncake TE; priority and shaping"),
}

_EXTRA_HINT = {
    "ucxx": "ucx",
    "torch": "model",
    "transformers": "model",
    "matplotlib": "bench",
    "tqdm": "bench",
    "pyroute2": "bench",
    "cupy": "gpu",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lynx",
        description="Lynx: anchor-first KV cache streaming and speculative decoding.",
    )
    parser.add_argument("--log-level", default=None,
                        choices=["debug", "info", "warning", "error"],
                        help="logging level for lynx messages (default: warning; info for `serve`, "
                             "which logs one line per request)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        _load(module).add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(module)


#: Loggers shown at INFO by every subcommand unless ``--log-level`` is given: the
#: one-time work a first run waits for (the default model's conversion, ~30 s).
SHOWN_AT_INFO = ("lynx_decode.model.store",)


def configure_logging(args: argparse.Namespace) -> None:
    """The CLI's logging: ``--log-level`` for everything, else WARNING, and the
    subcommand's own ``DEFAULT_LOG_LEVEL`` (``serve``: INFO) for Lynx's loggers only;
    :data:`SHOWN_AT_INFO` at INFO unless ``--log-level`` says otherwise."""
    logging.basicConfig(level=(args.log_level or "warning").upper(),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    default = getattr(_load(args._module), "DEFAULT_LOG_LEVEL", None)
    for name in ("lynx_decode", "lynx_transport", "lynx_bench"):
        logging.getLogger(name).setLevel(
            default.upper() if args.log_level is None and default is not None else logging.NOTSET)
    for name in SHOWN_AT_INFO:
        logging.getLogger(name).setLevel(logging.INFO if args.log_level is None else logging.NOTSET)


#: MKL's conditional numerical reproducibility, strict: a matrix product gives the same
#: bits whatever torch's thread count. Without it (seen on AMD EPYC with torch's MKL) the
#: first model step, which runs on one thread fewer while the cache is still arriving,
#: differs from a step on the filled cache by ~1e-5 in the logits. Read by MKL when it
#: starts, so the CLI sets it (for itself and every node process it starts) before torch
#: loads; the library never writes the environment (embedders: see docs/design.md).
MKL_REPRODUCIBLE = ("MKL_CBWR", "AUTO,STRICT")

#: OpenMP's idle torch threads sleep instead of spinning. On a busy machine (another
#: process on a core, or the node's own transport threads) a spinning thread burns the
#: time slice its sibling needs to reach the next barrier: measured on the 2-core test
#: host beside two CPU hogs, a decode step at 4k tokens took 740 ms spinning and 90 ms
#: passive, the two-token verify pass 4.1 s and 0.21 s. Read when libgomp loads (with
#: torch), so the CLI sets it first, as MKL_REPRODUCIBLE; a value the user set wins.
OMP_PASSIVE = ("OMP_WAIT_POLICY", "PASSIVE")

#: What the CLI sets in its environment (each unless already set) before torch loads;
#: the node processes it starts inherit them.
PROCESS_ENV = (MKL_REPRODUCIBLE, OMP_PASSIVE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lynx`` command line; returns the process exit code."""
    for name, value in PROCESS_ENV:
        os.environ.setdefault(name, value)
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args)
    try:
        return int(_load(args._module).run(args) or 0)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        extra = _EXTRA_HINT.get(root)
        if extra is None:
            raise
        print(f"lynx: error: {root} is not installed; install it with "
              f"`pip install 'lynx-kv[{extra}]'` (or `make install`)", file=sys.stderr)
        return 3
    except LynxError as exc:
        print(f"lynx: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lynx: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
