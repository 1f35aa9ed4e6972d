"""``lynx serve``: the prefill node. Prints ``listening on HOST:PORT`` once it
accepts requests, then serves until interrupted (SIGINT/SIGTERM)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from lynx_bench.node_args import add_model_arguments, add_secret_argument, host_port, load_model, transport_config

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="address to accept requests on (default 127.0.0.1, an ephemeral port)")
    parser.add_argument("--no-prefill-cache", action="store_true",
                        help="prefill every request (default: reuse cached prefills from disk)")
    add_secret_argument(parser)
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    host, port = host_port(args.listen, flag="--listen")
    config = transport_config(args)
    model = load_model(args)
    from lynx_decode.prefill_cache import PrefillCache  # noqa: PLC0415
    from lynx_decode.prefill_node import PrefillNode  # noqa: PLC0415

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cache = None if args.no_prefill_cache else PrefillCache()
    with PrefillNode(model, host=host, port=port, cache=cache, config=config) as node:
        bound_host, bound_port = node.address
        print(f"listening on {bound_host}:{bound_port}", flush=True)
        node.serve(stop)
        print(f"served {node.served} requests", file=sys.stderr)
    return 0
