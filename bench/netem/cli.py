"""``lynx link up|down|show|status|measure``: an emulated link between network namespaces.

::

    lynx link up --rate 1gbit            # namespaces lynx-tx / lynx-rx, 1 Gbit/s each way
    lynx link up --rate 1gbit --hosts 3  # lynx-tx, lynx-rx0..2 on a bridge (lynx-sw);
                                         # everything tx sends, to all of them, at 1 Gbit/s
    lynx link show --json                # (`lynx link status` is the same)
    lynx link measure --seconds 3        # bulk TCP tx -> every decode host at once
    lynx link down                       # idempotent, whatever the number of hosts

Needs root; without it the error points to ``--link shaper``. This kernel may lack
netem: ``--delay/--jitter/--loss`` then fail with a clear error, nothing is set up.
"""

from __future__ import annotations

import argparse
import ipaddress
import json

from lynx_bench.common.errors import LinkError
from lynx_transport.errors import ConfigError

from .bulk import measure_fanout
from .config import MAX_HOSTS, LinkConfig, parse_duration, parse_percent, parse_rate
from .host import netem_available, require_root
from .link import Link, teardown
from .status import LinkStatus, inspect_link

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="link_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="create and shape the link",
                        description="Create namespaces PREFIX-tx and PREFIX-rx joined by a "
                                    "veth pair, rate-limited both ways with htb; with --hosts K > 1, "
                                    "PREFIX-tx and PREFIX-rx0 .. PREFIX-rx<K-1> on a bridge in "
                                    "PREFIX-sw, each host's egress rate-limited with htb (so all "
                                    "that tx sends, to every decode host together, is held to the rate).")
    up.add_argument("--rate", required=True,
                    help="link rate: tc bit units (1gbit, 500mbit, 100kbit) or plain Gbit/s (2.5)")
    up.add_argument("--hosts", type=int, default=1,
                    help=f"decode hosts, 1-{MAX_HOSTS} (default 1: two namespaces and one veth pair)")
    up.add_argument("--subnet", default=None,
                    help="private IPv4 subnet for the hosts (default 10.254.0.0/30 for one "
                         "decode host, 10.254.0.0/27 for more)")
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
    sub.add_parser("show", aliases=["status"],
                   help="hosts, namespaces, addresses, qdiscs and rates "
                        "(exit 1 if the link is only partly there)")

    measure = sub.add_parser("measure", help="bulk TCP transfer tx -> decode hosts at once; "
                                             "print the achieved rate")
    measure.add_argument("--seconds", type=float, default=3.0,
                         help="how long the transfers should take together at the shaped rate "
                              "(default 3)")
    measure.add_argument("--to", default=None, metavar="HOST,...",
                         help="decode hosts to send to at once, e.g. rx0,rx2 (default: all)")
    measure.add_argument("--realtime", action="store_true",
                         help="run both ends SCHED_FIFO (chrt) so other load cannot starve them")

    for p in (up, sub.choices["down"], sub.choices["show"], measure):
        p.add_argument("--prefix", default="lynx",
                       help="names: PREFIX-tx / PREFIX-rx[<i>] / PREFIX-sw (default lynx)")
        p.add_argument("--json", action="store_true", help="print JSON")


def _config(args: argparse.Namespace):
    return LinkConfig(rate_gbps=parse_rate(args.rate), prefix=args.prefix, subnet=args.subnet,
                      delay_ms=parse_duration(args.delay), jitter_ms=parse_duration(args.jitter),
                      loss_pct=parse_percent(args.loss), lanes=args.lanes,
                      lane_port_base=args.lane_port_base, lane_port_block=args.lane_port_block,
                      burst_bytes=args.burst, hosts=args.hosts)


def _print_status(status: LinkStatus, ucx: dict[str, dict[str, str]] | None) -> None:
    netem = {True: "available", False: "NOT available in this kernel (no delay/loss/jitter)",
             None: "not probed"}[status.netem_available]
    hosts = f"   {status.hosts} decode host{'s' if status.hosts != 1 else ''}" if status.present else ""
    print(f"link {status.prefix}: {'up' if status.up else 'down'}{hosts}   netem: {netem}")
    if (sw := status.switch) is not None:
        if sw.present:
            print(f"  switch: netns {sw.namespace}  bridge {sw.bridge} ({sw.state or 'missing'})"
                  f"  ports {', '.join(sw.ports) or 'none'}  unshaped")
        else:
            print(f"  switch: namespace {sw.namespace} absent")
    for side in status.sides:
        if not side.present:
            print(f"  {side.host}: namespace {side.namespace} absent")
            continue
        rate = f"{side.rate_gbps:g} Gbit/s" if side.rate_gbps is not None else "unshaped"
        print(f"  {side.host}: netns {side.namespace}  dev {side.device} ({side.state or '?'})"
              f"  {', '.join(side.addresses) or 'no address'}  egress {rate}")
        for q in side.qdiscs:
            print(f"      qdisc {q.kind} {q.handle} parent {q.parent} {q.options}".rstrip())
        for c in sorted(side.classes, key=lambda c: (c.parent != "root", c.handle)):
            print(f"      class {c.handle} parent {c.parent} prio {c.prio} "
                  f"rate {c.rate_gbps:g} ceil {c.ceil_gbps:g} Gbit/s")
        if ucx:
            env = " ".join(f"{k}={v}" for k, v in ucx[side.host].items())
            print(f"      UCX env: {env}")


def run(args: argparse.Namespace) -> int:
    if args.link_command == "up":
        config = _config(args)  # ConfigError before touching the system
        link = Link(config).up()
        try:
            status = inspect_link(config.prefix, netem_available())
        except BaseException:  # Ctrl-C or a failure after the link came up: undo it
            link.down()
            raise
        ucx = {config.host_name(h): link.ucx_env(h) for h in (link.prefill_host, *link.decode_hosts)}
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
    if args.link_command in ("show", "status"):
        require_root()
        status = inspect_link(args.prefix, netem_available())
        if args.json:
            print(json.dumps(status.to_dict(), indent=2))
        else:
            _print_status(status, None)
        return 0 if status.up or not status.present else 1
    # measure
    if not 0 < args.seconds <= 60:
        raise ConfigError(f"--seconds must be in (0, 60], got {args.seconds}")
    require_root()
    status = inspect_link(args.prefix)
    if not status.up or status.sides[0].rate_gbps is None:
        raise LinkError(f"link {args.prefix} is not up; run `lynx link up --prefix "
                        f"{args.prefix} --rate ...` first")
    rate = status.sides[0].rate_gbps
    link = Link(LinkConfig(rate_gbps=rate, prefix=args.prefix, hosts=status.hosts,
                           subnet=_subnet_of(status.sides[0].addresses)))
    to = None if args.to is None else [h.strip() for h in args.to.split(",") if h.strip()]
    targets = link.decode_hosts if to is None else tuple(link.host(h) for h in to)
    # every stream gets its share of the rate: together they take --seconds
    n_bytes = int(rate * 1e9 / 8 * args.seconds / len(targets))
    result = measure_fanout(link, n_bytes, targets, timeout_s=max(30.0, 10 * args.seconds),
                            realtime=args.realtime)
    per_host = [{"host": link.config.host_name(h), "bytes": r.bytes, "seconds": r.seconds,
                 "gbps": r.gbps} for h, r in result.per_host]
    out = {"prefix": args.prefix, "shaped_gbps": rate, "bytes": result.bytes,
           "seconds": result.seconds, "achieved_gbps": result.gbps,
           "ratio": result.gbps / rate, "htb_gbps": result.htb_gbps,
           "htb_ratio": result.htb_gbps / rate, "hosts": per_host}
    if args.json:
        print(json.dumps(out))
    else:
        if len(per_host) > 1:
            for h in per_host:
                print(f"  {h['host']}: {h['bytes']} bytes in {h['seconds']:.3f} s: "
                      f"{h['gbps']:.3f} Gbit/s")
        print(f"{result.bytes} bytes in {result.seconds:.3f} s: {result.gbps:.3f} Gbit/s "
              f"({100 * result.gbps / rate:.1f}% of the shaped {rate:g} Gbit/s; the prefill's "
              f"htb let out {result.htb_gbps:.3f} Gbit/s of frames)")
    return 0


def _subnet_of(addresses: tuple[str, ...]) -> str:
    if not addresses:
        raise ConfigError("the link's tx side has no IPv4 address")
    return str(ipaddress.ip_interface(addresses[0]).network)
