"""``lynx link up|down|show|measure``: an emulated link between two network namespaces.

::

    lynx link up --rate 1gbit            # namespaces lynx-tx / lynx-rx, 1 Gbit/s each way
    lynx link show --json
    lynx link measure --seconds 3        # bulk TCP tx -> rx, achieved Gbit/s
    lynx link down                       # idempotent

Needs root; without it the error points to ``--link shaper``. This kernel may lack
netem: ``--delay/--jitter/--loss`` then fail with a clear error, nothing is set up.
"""

from __future__ import annotations

import argparse
import json

from lynx_transport.errors import ConfigError, LinkError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="link_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="create and shape the link",
                        description="Create namespaces PREFIX-tx and PREFIX-rx joined by a "
                                    "veth pair, rate-limited both ways with htb.")
    up.add_argument("--rate", required=True,
                    help="link rate: tc bit units (1gbit, 500mbit, 100kbit) or plain Gbit/s (2.5)")
    up.add_argument("--subnet", default="10.254.0.0/30",
                    help="private IPv4 subnet for the two ends (default 10.254.0.0/30)")
    up.add_argument("--delay", default="0", help="one-way delay each way, e.g. 5ms (needs netem)")
    up.add_argument("--jitter", default="0", help="delay jitter, e.g. 1ms (needs netem)")
    up.add_argument("--loss", default="0", help="packet loss each way, e.g. 0.1%% (needs netem)")
    up.add_argument("--lanes", type=int, default=0,
                    help="per-lane htb priority classes by TCP port range (default 0: none)")
    up.add_argument("--lane-port-base", type=int, default=40960,
                    help="first port of lane 0's range (default 40960)")
    up.add_argument("--lane-port-block", type=int, default=256,
                    help="ports per lane, a power of two (default 256)")
    up.add_argument("--burst", type=int, default=None,
                    help="htb burst in bytes (default: 1 ms at the rate, at least 128 KiB)")

    sub.add_parser("down", help="remove the link and end processes inside it (idempotent)")
    sub.add_parser("show", help="namespaces, addresses, qdiscs and rates "
                                "(exit 1 if the link is only partly there)")

    measure = sub.add_parser("measure", help="bulk TCP transfer tx -> rx; print achieved rate")
    measure.add_argument("--seconds", type=float, default=3.0,
                         help="how long the transfer should take at the shaped rate (default 3)")
    measure.add_argument("--realtime", action="store_true",
                         help="run both ends SCHED_FIFO (chrt) so other load cannot starve them")

    for p in (up, sub.choices["down"], sub.choices["show"], measure):
        p.add_argument("--prefix", default="lynx",
                       help="names: PREFIX-tx / PREFIX-rx (default lynx)")
        p.add_argument("--json", action="store_true", help="print JSON")


def _config(args: argparse.Namespace):
    from .link_config import LinkConfig, parse_duration, parse_percent, parse_rate

    return LinkConfig(rate_gbps=parse_rate(args.rate), prefix=args.prefix, subnet=args.subnet,
                      delay_ms=parse_duration(args.delay), jitter_ms=parse_duration(args.jitter),
                      loss_pct=parse_percent(args.loss), lanes=args.lanes,
                      lane_port_base=args.lane_port_base, lane_port_block=args.lane_port_block,
                      burst_bytes=args.burst)


def _print_status(status, ucx: dict[str, dict[str, str]] | None) -> None:
    netem = {True: "available", False: "NOT available in this kernel (no delay/loss/jitter)",
             None: "not probed"}[status.netem_available]
    print(f"link {status.prefix}: {'up' if status.up else 'down'}   netem: {netem}")
    for side in status.sides:
        if not side.present:
            print(f"  {side.side.value}: namespace {side.namespace} absent")
            continue
        rate = f"{side.rate_gbps:g} Gbit/s" if side.rate_gbps is not None else "unshaped"
        print(f"  {side.side.value}: netns {side.namespace}  dev {side.device} ({side.state or '?'})"
              f"  {', '.join(side.addresses) or 'no address'}  egress {rate}")
        for q in side.qdiscs:
            print(f"      qdisc {q.kind} {q.handle} parent {q.parent} {q.options}".rstrip())
        for c in sorted(side.classes, key=lambda c: (c.parent != "root", c.handle)):
            print(f"      class {c.handle} parent {c.parent} prio {c.prio} "
                  f"rate {c.rate_gbps:g} ceil {c.ceil_gbps:g} Gbit/s")
        if ucx:
            env = " ".join(f"{k}={v}" for k, v in ucx[side.side.value].items())
            print(f"      UCX env: {env}")


def run(args: argparse.Namespace) -> int:
    from .link import Link, teardown
    from .link_config import LinkConfig, Side
    from .link_status import inspect_link
    from .link_sys import netem_available, require_root

    if args.link_command == "up":
        config = _config(args)  # ConfigError before touching the system
        link = Link(config).up()
        try:
            status = inspect_link(config.prefix, netem_available())
        except BaseException:  # Ctrl-C or a failure after the link came up: undo it
            link.down()
            raise
        ucx = {s.value: link.ucx_env(s) for s in Side}
        lanes = {str(i): config.lane_ports(i).ucx for i in range(config.lanes)}
        if args.json:
            print(json.dumps({**status.to_dict(), "ucx_env": ucx,
                              "lane_port_ranges": lanes}, indent=2))
        else:
            _print_status(status, ucx)
            for lane, ports in lanes.items():
                print(f"  lane {lane}: UCX_TCP_PORT_RANGE={ports}")
        return 0
    if args.link_command == "down":
        removed = teardown(args.prefix)
        if args.json:
            print(json.dumps({"prefix": args.prefix, "removed": removed}))
        else:
            print(f"removed {', '.join(removed)}" if removed
                  else f"link {args.prefix}: nothing to remove")
        return 0
    if args.link_command == "show":
        require_root()
        status = inspect_link(args.prefix, netem_available())
        if args.json:
            print(json.dumps(status.to_dict(), indent=2))
        else:
            _print_status(status, None)
        return 0 if status.up or not status.present else 1
    # measure
    from .link_bulk import measure

    if not 0 < args.seconds <= 60:
        raise ConfigError(f"--seconds must be in (0, 60], got {args.seconds}")
    require_root()
    status = inspect_link(args.prefix)
    if not status.up or status.sides[0].rate_gbps is None:
        raise LinkError(f"link {args.prefix} is not up; run `lynx link up --prefix "
                          f"{args.prefix} --rate ...` first")
    rate = status.sides[0].rate_gbps
    subnet_cfg = LinkConfig(rate_gbps=rate, prefix=args.prefix,
                            subnet=_subnet_of(status.sides[0].addresses))
    n_bytes = int(rate * 1e9 / 8 * args.seconds)
    result = measure(Link(subnet_cfg), n_bytes, timeout_s=max(30.0, 10 * args.seconds),
                     realtime=args.realtime)
    out = {"prefix": args.prefix, "shaped_gbps": rate, "bytes": result.bytes,
           "seconds": result.seconds, "achieved_gbps": result.gbps,
           "ratio": result.gbps / rate}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{result.bytes} bytes in {result.seconds:.3f} s: {result.gbps:.3f} Gbit/s "
              f"({100 * result.gbps / rate:.1f}% of the shaped {rate:g} Gbit/s)")
    return 0


def _subnet_of(addresses: tuple[str, ...]) -> str:
    import ipaddress

    if not addresses:
        raise ConfigError("the link's tx side has no IPv4 address")
    return str(ipaddress.ip_interface(addresses[0]).network)
