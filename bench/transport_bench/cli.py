"""``lynx bench-transport``: Lynx's transport against raw ucxx, ucx_perftest, asyncio TCP, NIXL
and Mooncake Transfer Engine.

Two processes on loopback. Every backend moves the same ``--size-mib``
messages; the rounds interleave the backends so machine noise hits them alike,
and each reports the median over all its messages (decimal Gbit/s, measured
from the first byte handed over to the receiver's confirmation):

* ``lynx_gbps`` - ``Connection.send_stream`` of one region, confirmed by the receiver;
* ``ucxx_gbps`` - raw ucxx tagged send/recv on the same UCX path;
* ``ucx_perftest_gbps`` - ``ucx_perftest -t tag_bw``, same ``UCX_TLS``, no ``-e``;
  ``ucx_perftest_tcp_gbps`` the same over ``UCX_TLS=tcp``, UCX's own ceiling beside
  ``lynx_tcp_gbps`` (``lynx_tcp_vs_ucx_perftest_tcp``);
* ``lynx_written_gbps`` / ``ucxx_written_gbps`` - the same from a written buffer;
* ``asyncio_tcp_gbps`` - plain asyncio TCP sockets (a written buffer);
* ``lynx_tcp_gbps`` - Lynx over ``UCX_TLS=tcp`` (untouched buffer), the path of
  the TCP peers below;
* ``nixl_gbps`` - NIXL (:mod:`lynx_bench.transport_bench.peers.nixl`) on the same UCX path as
  ``lynx_gbps``, in the faster of its two documented configurations in this run
  (``nixl_config``; both are reported: ``nixl_progress_thread_gbps``,
  ``nixl_polling_gbps``); ``nixl_written_gbps`` the same from a written buffer
  (``lynx_written_vs_nixl_written``); ``nixl_tcp_gbps`` over ``UCX_TLS=tcp``;
* ``mooncake_tcp_gbps`` - Mooncake TE (:mod:`lynx_bench.transport_bench.peers.mooncake`) over TCP;
* ``lynx_vs_nixl``, ``lynx_tcp_vs_nixl_tcp``, ``lynx_tcp_vs_mooncake_tcp`` - the ratios.

Each peer engine runs as two processes of its own, sends from a never-written
buffer like ``lynx_gbps``, and times a message from its initiator's call to its
own completion (the bytes in the target's memory). An engine that is not
installed is listed under ``skipped`` with its install hint (``--install-peers``);
its fields and ratios are null.

``latency`` - per backend, per message size (64 KiB and 1 MiB: an anchor lane
is latency-bound), ``median_us`` and ``p99_us`` per message over all rounds;
``lynx``/``lynx_tcp`` are a whole stream on the anchor lane (``send_stream`` ->
the sender hears the receiver's STREAM_DONE), ``lynx_oneway``/``lynx_tcp_oneway``
the same streams from ``send_stream`` to the receiver's ``on_region`` callback
(one monotonic clock for both processes), ``ucx_perftest`` its ``tag_lat``
50th percentile (half a ping-pong; no p99), the peers' one write each as the
initiator sees it done, and ``nixl_notified`` NIXL's write with a notification
until the target's ``get_new_notifs`` returns it (the way a consumer learns of it).
``lynx_p99_64k_vs_best_peer`` (and ``lynx_tcp_...``) divide Lynx's 64 KiB P99
by the lowest peer P99 on the same path; ``lynx_oneway_64k_vs_ucx_perftest``,
``lynx_tcp_oneway_64k_vs_mooncake_tcp`` and ``lynx_oneway_1m_vs_nixl_polling``
divide the one-way medians.

``ucx_perftest`` never writes its send buffer: over cma (the default path on one
host) its receiver copies from the kernel's shared zero page, which stays in
cache, so it runs ~1.3-1.5x faster than a copy of real memory (measured here:
raw ucxx 53-55 Gbit/s from a written buffer, 68-75 from an untouched one).
``lynx_gbps`` and ``ucxx_gbps`` therefore send from an untouched buffer too,
huge-page eligible like perftest's (UCX's allocator madvises its buffers; a
never-written huge page reads the 2 MiB huge zero page, a 4 KiB one the 4 KiB
zero page, which copies ~25% faster: match both), so ``lynx_vs_ucx_perftest``
compares like with like; ``lynx_vs_asyncio_tcp`` uses
``lynx_written_gbps``. The receive side is written memory for every backend
(Lynx's pre-faulted pool; the baselines' buffers after their first message).
Every timed group of messages (and ``ucx_perftest``'s timed iterations) follows
``WARM_UP_S`` of the same sends: this VM speeds up over ~50 ms of steady
traffic (raw ucxx rose 60 -> 96 Gbit/s over five back-to-back messages).

* ``anchor_under_load_ratio`` - a stream's anchor lane completion time while a
  residual stream saturates a shaped link, over the ideal ``anchor bytes / rate``;
* ``shaping_error`` - worst ``|achieved - configured| / configured`` over the
  shaped rates, achieved = ``(bytes - burst - chunk) / time``: the bucket lets
  its burst plus one chunk go at once and promises the rate for the rest;
  ``shaping_error_tcp`` the same over ``UCX_TLS=tcp``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from lynx_bench.transport_bench.peers.engines import Engine
from lynx_bench.transport_bench.targets import TARGETS

if TYPE_CHECKING:
    from lynx_transport import TransportConfig

__all__ = ["add_arguments", "run", "measure", "TARGETS", "engines"]

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--size-mib", type=int, default=64, help="message size (default 64 MiB)")
    parser.add_argument("--messages", type=int, default=5,
                        help="messages per backend per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--chunk-kib", type=int, default=None,
                        help="Lynx chunk size (default: TransportConfig's, 1024)")
    parser.add_argument("--inflight-mib", type=int, default=None,
                        help="Lynx bytes-in-flight bound (default: TransportConfig's, 32)")
    parser.add_argument("--rails", type=int, default=None,
                        help="Lynx receive rails (default: TransportConfig's, 2)")
    parser.add_argument("--tls", default=None,
                        help="UCX_TLS for every UCX backend (default: TransportConfig's, ^posix,sysv)")
    parser.add_argument("--link-gbps", type=float, default=1.0,
                        help="shaped link rate for the anchor-under-load run (default 1.0)")
    parser.add_argument("--shaping-gbps", default="0.5,1,4",
                        help="comma-separated rates for the shaping-error run (default 0.5,1,4)")
    parser.add_argument("--peers", default="nixl,mooncake",
                        help="peer engines to measure, comma-separated from nixl, mooncake; 'none' for "
                             "none (default: both; one not installed is reported as skipped)")
    parser.add_argument("--latency-messages", type=int, default=100,
                        help="messages per size per backend per round for the latency run (default 100)")
    parser.add_argument("--install-peers", action="store_true",
                        help="install the --peers engines into this environment (NIXL without its "
                             "CUDA torch) and exit")
    parser.add_argument("--quick", action="store_true", help="one round, fewer messages")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a target is missed (see TARGETS)")


def engines(spec: str) -> list[Engine]:
    """``--peers``: ``nixl,mooncake``, one of them, or ``none``."""
    names = [] if spec.strip() == "none" else [x.strip() for x in spec.split(",") if x.strip()]
    known = {e.value: e for e in Engine}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"lynx bench-transport: unknown --peers {', '.join(unknown)} "
                         f"(choose from {', '.join(known)} or none)")
    return [known[n] for n in names]


def _config(args: argparse.Namespace) -> TransportConfig:
    """Lynx's TransportConfig for ``args``; fills the Lynx flags left unset (``--tls``,
    ``--chunk-kib``, ``--inflight-mib``, ``--rails``) with TransportConfig's defaults."""
    from lynx_transport import TransportConfig  # noqa: PLC0415 - with the rest of the run's imports

    default = TransportConfig()
    args.tls = default.ucx_tls if args.tls is None else args.tls
    args.chunk_kib = default.chunk_bytes // 1024 if args.chunk_kib is None else args.chunk_kib
    args.inflight_mib = (default.max_inflight_bytes // MiB if args.inflight_mib is None
                         else args.inflight_mib)
    args.rails = default.rails if args.rails is None else args.rails
    return TransportConfig(chunk_bytes=args.chunk_kib * 1024,
                           max_inflight_bytes=args.inflight_mib * MiB, ucx_tls=args.tls,
                           rails=args.rails)


def measure(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Run every backend; returns the result dictionary (see the module docstring).

    Each round calls the runners of :meth:`~lynx_bench.transport_bench.backends.Backends.runners`
    in their order (the interleaving) and merges their records; Lynx's shaped runs follow
    the rounds (:meth:`~lynx_bench.transport_bench.lynx_runs.LynxPaths.after_rounds`)."""
    from lynx_bench.transport_bench.backends import Backends  # noqa: PLC0415 - the run's imports
    from lynx_bench.transport_bench.results import summarize  # noqa: PLC0415
    from lynx_bench.transport_bench.runner import Plan, Record  # noqa: PLC0415

    say = progress or (lambda msg: None)
    selected = engines(args.peers)
    # before anything here imports ucxx, which adds UCX_* variables of its own
    ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    config = _config(args)
    rounds, messages = (1, 3) if args.quick else (args.rounds, args.messages)
    plan = Plan(nbytes=args.size_mib * MiB, rounds=rounds, messages=messages, tls=args.tls,
                latency_messages=min(args.latency_messages, 30) if args.quick else args.latency_messages)
    rates = [float(x) for x in args.shaping_gbps.split(",")]
    # the JSON's per-message order: these first, then the peers as they ran
    record = Record(throughput_s={name: [] for name in (
        "lynx", "lynx_written", "ucxx", "ucxx_written", "asyncio_tcp", "lynx_tcp")})
    backends = Backends(plan, config, rates, selected, ucx_env)
    try:
        say("starting the backends")
        backends.start()
        for r in range(rounds):
            phase = None
            for runner in backends.runners():
                if runner.phase != phase:
                    phase = runner.phase
                    say(f"round {r + 1}/{rounds}: {phase}")
                record.add(runner.run(plan))
        after = backends.lynx.after_rounds(args.link_gbps, 1 if args.quick else 3, rates, say)
        backends.stop_tcp()
    finally:
        backends.close()
    assert backends.peers is not None
    return summarize(record, after, plan, config, args.link_gbps, backends.peers.skipped)


def run(args: argparse.Namespace) -> int:
    if args.install_peers:
        from lynx_bench.transport_bench.peers.install import install_peers  # noqa: PLC0415 - only for --install-peers

        return install_peers(engines(args.peers))
    result = measure(args, progress=lambda msg: print(f"lynx bench-transport: {msg}",
                                                      file=sys.stderr, flush=True))
    keys = ["lynx_gbps", "ucxx_gbps", "ucx_perftest_gbps", "lynx_written_gbps",
            "ucxx_written_gbps", "asyncio_tcp_gbps", "lynx_vs_ucx_perftest",
            "lynx_vs_ucxx_written", "lynx_vs_asyncio_tcp", "lynx_tcp_gbps", "nixl_gbps",
            "nixl_progress_thread_gbps", "nixl_polling_gbps", "nixl_tcp_gbps",
            "nixl_tcp_progress_thread_gbps", "nixl_tcp_polling_gbps", "mooncake_tcp_gbps",
            "nixl_written_gbps", "nixl_progress_thread_written_gbps", "nixl_polling_written_gbps",
            "lynx_vs_nixl", "lynx_written_vs_nixl_written", "lynx_tcp_vs_nixl_tcp", "lynx_tcp_vs_mooncake_tcp",
            "lynx_p99_64k_vs_best_peer", "lynx_tcp_p99_64k_vs_best_peer",
            "anchor_under_load_ratio", "shaping_error", "shaping_error_tcp",
            "lynx_oneway_64k_median_us", "lynx_oneway_64k_p99_us", "lynx_oneway_64k_vs_ucx_perftest",
            "lynx_tcp_oneway_64k_vs_mooncake_tcp", "lynx_oneway_1m_vs_nixl_polling",
            "ucx_perftest_tcp_gbps", "lynx_tcp_vs_ucx_perftest_tcp"]
    for key in keys:
        target = TARGETS.get(key)
        met = result["targets_met"].get(key)
        mark = "" if target is None else (
            f"   (target {target[0]} {target[1]}: "
            f"{'skipped' if met is None else 'met' if met else 'MISSED'})")
        print(f"{key:<30} {'skipped' if result[key] is None else result[key]}{mark}")
    print(f"(NIXL's faster configuration: {result['nixl_config']} on the default path "
          f"({result['nixl_written_config']} from a written buffer), {result['nixl_tcp_config']} over tcp)")
    for engine, reason in result["skipped"].items():
        print(f"skipped {engine}: {reason}")
    d = result["details"]
    rows = [*result["latency"].items(),
            *((f"{name} (data path)", sizes) for name, sizes in d["lynx_data_path_latency"].items())]
    for name, sizes in rows:
        print(f"latency {name:<26} " + ", ".join(
            f"{int(size) >> 10} KiB median {s['median_us']} us P99 "
            f"{'-' if s['p99_us'] is None else s['p99_us']} us"
            for size, s in sizes.items()))
    print(f"(messages of {d['message_bytes']} B, UCX_TLS={d['ucx_tls']}, error handling: "
          f"{d['ucx_error_handling']}; Lynx: {d['chunk_bytes']} B chunks, "
          f"{d['max_inflight_bytes']} B in flight, {d['rails']} receive rails; "
          f"send buffers: {d['send_buffers']})")
    for side in ("sender_lanes", "receiver_lanes"):
        for lane in d[side]:
            print(f"{side:<15} lane {lane['lane']}: {lane['bytes']} B in {lane['chunks']} chunks, "
                  f"{lane['achieved_gbps']} Gbit/s, queued {lane['queued_bytes']} B, "
                  f"in flight {lane['inflight_bytes']} B")
    for which in ("shaping", "shaping_tcp"):
        for rate, e in d[which].items():
            print(f"{which} {rate} Gbit/s: achieved {e['achieved_gbps']} (error {e['error']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.check and any(met is False for met in result["targets_met"].values()):
        return 1
    return 0
