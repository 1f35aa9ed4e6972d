"""Does sending before the ACCEPT pay? One-way and whole-stream latency, A/B in one run.

A receiver in this process, a sender in a child (both real UCX, loopback). Each
round sends ``--streams`` one-region anchor streams per size with
``TransportConfig.send_before_accept`` on (``OPEN_SENT``: the chunks follow the
manifest at once) and the same with it off (``OPEN`` -> ACCEPT -> chunks), the two
interleaved round by round. Per stream, on one clock (``time.monotonic()``, shared by
the host's processes):

* ``oneway``  - the sender's ``send_stream()`` call -> the receiver's ``on_region``
  callback for the region (what a consumer waits for);
* ``first``   - ``send_stream()`` -> the first chunk handed to UCX at the sender;
* ``whole``   - ``send_stream()`` -> the sender hears STREAM_DONE.

Prints medians and P99s (microseconds) per mode and size, and the ratio of the
one-way medians (on / off).

    python experiments/first_byte.py --streams 200 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import statistics
import time
from typing import Any

SIZES = (64 << 10, 1 << 20)


def _sender(pipe: Any, address: tuple[str, int], config: Any) -> None:
    import numpy as np  # noqa: PLC0415 - in the child

    from lynx_transport import UCX, Lane  # noqa: PLC0415

    conn = UCX.connect(address, timeout=30, config=config)
    buffers = {n: np.ones(n, np.uint8) for n in SIZES}
    pipe.send("ready")
    while (size := pipe.recv()) is not None:
        s = conn.send_stream([("anchor", buffers[size], Lane.ANCHOR)])
        s.wait(30)
        pipe.send((s.stream_id, s.opened_at, s.started_at, s.completed_at))
    conn.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]  # nearest rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200, help="streams per size per mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the two modes interleaved")
    parser.add_argument("--tls", default="^posix,sysv", help="UCX_TLS of both sides")
    args = parser.parse_args()

    from lynx_transport import ReceivePool, Receiver, TransportConfig  # noqa: PLC0415

    landed: dict[int, float] = {}
    config = TransportConfig(ucx_tls=args.tls)
    rx = Receiver(ReceivePool(64 << 20), config=config,
                  on_region=lambda s, _r: landed.__setitem__(s.stream_id, time.monotonic()),
                  on_stream_complete=lambda s: s.release())
    ctx = multiprocessing.get_context("spawn")
    modes = {"send_before_accept": True, "wait_for_accept": False}
    pipes, children = {}, []
    for mode, on in modes.items():
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=_sender, args=(theirs, rx.address,
                                                  dataclasses.replace(config, send_before_accept=on)))
        child.start()
        assert mine.recv() == "ready"
        pipes[mode] = mine
        children.append(child)
    got: dict[tuple[str, int], dict[str, list[float]]] = {}
    try:
        for _ in range(args.rounds):
            for mode, pipe in pipes.items():
                for size in SIZES:
                    row = got.setdefault((mode, size), {"oneway": [], "first": [], "whole": []})
                    for k in range(args.streams + 10):  # 10 warm-up streams
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
    finally:
        for pipe in pipes.values():
            pipe.send(None)
        for child in children:
            child.join(30)
        rx.close()
    print(f"{'mode':<20} {'size':>8} " + " ".join(f"{c + ' p50/p99 us':>22}" for c in ("oneway", "first", "whole")))
    for (mode, size), row in got.items():
        print(f"{mode:<20} {size >> 10:>6}Ki " + " ".join(
            f"{statistics.median(v) * 1e6:>10.1f}/{_percentile(v, 0.99) * 1e6:<11.1f}" for v in row.values()))
    for size in SIZES:
        on = statistics.median(got["send_before_accept", size]["oneway"])
        off = statistics.median(got["wait_for_accept", size]["oneway"])
        print(f"oneway median, send_before_accept / wait_for_accept, {size >> 10} KiB: {on / off:.3f}")


if __name__ == "__main__":
    main()
