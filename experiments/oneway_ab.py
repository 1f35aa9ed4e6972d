"""One TransportConfig switch, on and off: one-way and whole-stream latency, and the CPU it costs, A/B in one run.

A receiver in this process, a sender in a child (both real UCX, loopback). Each
round sends ``--streams`` one-region anchor streams per size with the switch
(``--knob``) on, then the same with it off, the two interleaved round by round.
Each block starts its own receiver and sender and stops them after, so one
mode's threads never run beside the other's (a polling loop would take a core
from the mode being measured). The switches:

* ``send_before_accept`` - the chunks follow the manifest at once (``OPEN_SENT``)
  against OPEN -> ACCEPT -> chunks;
* ``busy_poll`` - the latency mode: I/O threads that poll instead of sleeping;
* ``send_from_caller`` - ``send_stream()`` runs on the caller's thread when the
  sender's I/O thread is waiting, against handing every call to that thread.

Per stream, on one clock (``time.monotonic()``, shared by the host's processes):

* ``oneway``  - the sender's ``send_stream()`` call -> the receiver's ``on_region``
  callback for the region (what a consumer waits for);
* ``first``   - ``send_stream()`` -> the first chunk handed to UCX at the sender;
* ``whole``   - ``send_stream()`` -> the sender hears STREAM_DONE.

Prints medians and P99s (microseconds) per mode and size, the ratio of the one-way
medians (on / off), and per mode the CPU the two processes used over the blocks'
wall time (in cores: 1.0 is one core busy the whole time).

    python experiments/oneway_ab.py --knob busy_poll --streams 150 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import resource
import statistics
import time
from typing import Any

SIZES = (64 << 10, 1 << 20)
KNOBS = ("send_before_accept", "busy_poll", "send_from_caller")


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _sender(pipe: Any, address: tuple[str, int], config: Any) -> None:
    import numpy as np  # noqa: PLC0415 - in the child

    from lynx_transport import UCX, Lane  # noqa: PLC0415

    conn = UCX.connect(address, timeout=30, config=config)
    buffers = {n: np.ones(n, np.uint8) for n in SIZES}
    pipe.send(("ready", _cpu_s()))
    while (size := pipe.recv()) is not None:
        s = conn.send_stream([("anchor", buffers[size], Lane.ANCHOR)])
        s.wait(30)
        pipe.send((s.stream_id, s.opened_at, s.started_at, s.completed_at))
    pipe.send(_cpu_s())
    conn.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]  # nearest rank


def _block(ctx: Any, config: Any, streams: int, got: dict[int, dict[str, list[float]]]) -> tuple[float, float]:
    """One mode's block: a fresh receiver and sender, ``streams`` (+10 warm-up) per size;
    returns (CPU seconds of both processes, wall seconds) over the timed streams."""
    from lynx_transport import ReceivePool, Receiver  # noqa: PLC0415

    landed: dict[int, float] = {}
    rx = Receiver(ReceivePool(64 << 20), config=config,
                  on_region=lambda s, _r: landed.__setitem__(s.stream_id, time.monotonic()),
                  on_stream_complete=lambda s: s.release())
    pipe, theirs = ctx.Pipe()
    child = ctx.Process(target=_sender, args=(theirs, rx.address, config))
    child.start()
    try:
        ready, child_cpu0 = pipe.recv()
        assert ready == "ready"
        cpu0, wall0 = _cpu_s(), time.monotonic()
        for size in SIZES:
            row = got.setdefault(size, {"oneway": [], "first": [], "whole": []})
            for k in range(streams + 10):  # 10 warm-up streams
                pipe.send(size)
                sid, opened, started, completed = pipe.recv()
                deadline = time.monotonic() + 10
                while sid not in landed and time.monotonic() < deadline:
                    time.sleep(1e-4)
                region = landed.pop(sid)
                if k >= 10:
                    row["oneway"].append(region - opened)
                    row["first"].append(started - opened)
                    row["whole"].append(completed - opened)
                time.sleep(0.001)
        cpu, wall = _cpu_s() - cpu0, time.monotonic() - wall0
        pipe.send(None)
        cpu += pipe.recv() - child_cpu0
    finally:
        child.join(30)
        rx.close()
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--knob", choices=KNOBS, default="send_before_accept",
                        help="the TransportConfig switch to compare on and off")
    parser.add_argument("--streams", type=int, default=200, help="streams per size per mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the two modes interleaved")
    parser.add_argument("--tls", default="^posix,sysv", help="UCX_TLS of both sides")
    args = parser.parse_args()

    from lynx_transport import TransportConfig  # noqa: PLC0415

    base = TransportConfig(ucx_tls=args.tls)
    ctx = multiprocessing.get_context("spawn")
    got: dict[bool, dict[int, dict[str, list[float]]]] = {True: {}, False: {}}
    cost = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for _ in range(args.rounds):
        for on in (True, False):
            cpu, wall = _block(ctx, dataclasses.replace(base, **{args.knob: on}), args.streams, got[on])
            cost[on][0] += cpu
            cost[on][1] += wall
    print(f"{'mode':<24} {'size':>8} " + " ".join(f"{c + ' p50/p99 us':>22}" for c in ("oneway", "first", "whole")))
    for on in (True, False):
        for size, row in got[on].items():
            print(f"{args.knob + ('=on' if on else '=off'):<24} {size >> 10:>6}Ki " + " ".join(
                f"{statistics.median(v) * 1e6:>10.1f}/{_percentile(v, 0.99) * 1e6:<11.1f}" for v in row.values()))
    for size in SIZES:
        ratio = statistics.median(got[True][size]["oneway"]) / statistics.median(got[False][size]["oneway"])
        print(f"oneway median, {args.knob} on / off, {size >> 10} KiB: {ratio:.3f}")
    for on in (True, False):
        cpu, wall = cost[on]
        print(f"{args.knob}={'on' if on else 'off'}: both processes {cpu:.1f} CPU s over {wall:.1f} s "
              f"({cpu / wall:.2f} cores)")


if __name__ == "__main__":
    main()
