"""``lynx serve``: the prefill node. Prints ``listening on HOST:PORT`` once it
accepts requests, then serves until interrupted (SIGINT/SIGTERM).

Listening beyond loopback without a shared secret logs one warning at startup
(:func:`exposure_warning`): the node then serves anyone who can reach its port.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from lynx_bench.common.node_args import (
    SECRET_ENV,
    add_model_arguments,
    add_secret_argument,
    add_timeout_arguments,
    add_ucx_arguments,
    check_model_arg,
    host_port,
    load_model,
    timeouts,
    transport_config,
)
from lynx_transport import UCX
from lynx_transport.config import MIN_SECRET_BYTES, TransportConfig
from lynx_transport.errors import ConfigError
from lynx_transport.protocol.scheduler import LanePolicy
from lynx_transport.protocol.shaper import Rate
from lynx_transport.seam import Transport

BURST_BYTES = 1 << 20  # as the prefill node's per-request shaping

if TYPE_CHECKING:
    from lynx_decode.model.protocol import CausalLM
    from lynx_decode.prefill_node import PrefillNode
    from lynx_decode.send_record import SendRecord

__all__ = ["add_arguments", "prefill_node", "run", "exposure_warning", "is_loopback"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="address to accept requests on (default 127.0.0.1, an ephemeral port; "
                             "beyond loopback, give the nodes a shared secret: --secret-file)")
    parser.add_argument("--no-prefill-cache", action="store_true",
                        help="prefill every request (default: reuse cached prefills from disk)")
    parser.add_argument("--rate", type=float, default=None, metavar="GBPS",
                        help="shape the node's egress (its replies to every decode node) to GBPS "
                             "Gbit/s (default: unshaped)")
    parser.add_argument("--max-pending", type=int, default=32, metavar="N",
                        help="requests admitted and not yet finished; more are refused as busy "
                             "at once (default 32)")
    parser.add_argument("--memory-cache", type=int, default=4, metavar="N",
                        help="recent prefills kept in memory (default 4; 0: none)")
    parser.add_argument("--lane-policy", choices=[p.value for p in LanePolicy], default=None,
                        help="order of the streams within a lane, across every request "
                             f"(default {TransportConfig().lane_policy.value}; see LanePolicy)")
    parser.add_argument("--records", default=None, metavar="FILE",
                        help="append one JSON line per sent request to FILE (lynx_decode.send_record: "
                             "request_id, first_byte_s, sent_s, bytes held, ...)")
    add_secret_argument(parser)
    add_timeout_arguments(parser)
    add_ucx_arguments(parser)
    add_model_arguments(parser)


def prefill_node(args: argparse.Namespace, model: CausalLM, transport: Transport = UCX,
                 on_sent: Callable[[SendRecord], None] | None = None) -> PrefillNode:
    """The prefill node the flags describe (address, cache, transport settings, every
    timeout); ``on_sent`` takes each sent request's record."""
    from lynx_decode.prefill_cache import PrefillCache  # noqa: PLC0415 - loads the decode stack
    from lynx_decode.prefill_node import PrefillNode  # noqa: PLC0415 - loads the decode stack

    host, port = host_port(args.listen, flag="--listen")
    cache = None if args.no_prefill_cache else PrefillCache()
    config = transport_config(args)
    if args.lane_policy is not None:
        config = dataclasses.replace(config, lane_policy=LanePolicy(args.lane_policy))
    return PrefillNode(model, host=host, port=port, cache=cache, config=config,
                       timeouts=timeouts(args), transport=transport, max_pending=args.max_pending,
                       memory_cache=args.memory_cache, link_rate=_rate(args), on_sent=on_sent)


def _rate(args: argparse.Namespace) -> Rate | None:
    if args.rate is None:
        return None
    if not (args.rate > 0 and math.isfinite(args.rate)):
        raise ConfigError(f"--rate: {args.rate:g} is not a positive number of Gbit/s")
    return Rate(args.rate, BURST_BYTES)


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP address or a name) only reaches this machine: a
    loopback address, or a name all of whose addresses are loopback ones
    (``localhost``). The unspecified ``0.0.0.0``/``::`` (every interface), any
    other address and a name that does not resolve are not."""
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
            addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]
        except (OSError, ValueError):
            return False
    return bool(addresses) and all(_loopback_ip(a) for a in addresses)


def _loopback_ip(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def exposure_warning(listen: str, secret: bytes | None) -> str | None:
    """The warning ``lynx serve --listen LISTEN`` logs at startup, or None: one when
    it listens beyond loopback with no shared secret (anyone who can reach the port
    can then send it requests and receive the KV caches it computes or keeps)."""
    host, port = host_port(listen, flag="--listen")
    if secret is not None or is_loopback(host):
        return None
    return (f"--listen {host}:{port} is reachable beyond this machine and no shared secret is "
            "set: anyone who can reach that port can send this node requests and receive the KV "
            "caches it computes or has cached. "
            f"Give every node the same secret of at least {MIN_SECRET_BYTES} bytes: --secret-file PATH (e.g. "
            "`head -c 32 /dev/urandom | base64 > lynx.secret`, then `--secret-file lynx.secret` "
            f"on `lynx serve` and `lynx generate`) or ${SECRET_ENV}")


#: ``lynx serve`` logs one line per request at INFO unless ``--log-level`` says otherwise.
DEFAULT_LOG_LEVEL = "info"


def run(args: argparse.Namespace) -> int:
    host_port(args.listen, flag="--listen")
    config = transport_config(args)  # bad flags fail before the model loads
    timeouts(args)
    _rate(args)
    for flag, value, low in (("--max-pending", args.max_pending, 1), ("--memory-cache", args.memory_cache, 0)):
        if value < low:
            raise ConfigError(f"{flag}: must be >= {low}, got {value}")
    check_model_arg(args)
    if (warning := exposure_warning(args.listen, config.secret)) is not None:
        log.warning("%s", warning)
    model = load_model(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from lynx_decode.send_record import RecordsFile  # noqa: PLC0415 - loads the decode stack

    records = None if args.records is None else RecordsFile(args.records)
    try:
        with prefill_node(args, model, on_sent=records) as node:
            bound_host, bound_port = node.address
            print(f"listening on {bound_host}:{bound_port}", flush=True)
            node.serve(stop)
            print(f"served {node.served} requests", file=sys.stderr)
    finally:
        if records is not None:
            records.close()
    return 0
