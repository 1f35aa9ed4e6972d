"""The floor of a Python data path over UCX: one tagged message, one way, no Lynx.

Two processes, one UCX worker each (the transports Lynx uses: ``^posix,sysv``
by default). The receiver posts every receive before the first message and
busy-polls its worker from Python; the sender stamps ``time.monotonic()`` into
the message, sends it, polls until the send completes, then polls for 2 ms
before the next. Per message, on the host's one clock:

* ``oneway`` - the sender's clock before the send call -> the receiver sees the
  receive complete (what no Python data path on this host can beat);
* ``call``   - how long the send call itself takes to return.

Two ways to make the calls, in separate runs, interleaved round by round:

* ``ucxx``   - ucxx's Python API (``UCXEndpoint.tag_send``, ``UCXWorker.tag_recv``,
  the request's ``completed``), what Lynx uses;
* ``ctypes`` - libucp's ``ucp_tag_send_nbx`` / ``ucp_tag_recv_nbx`` /
  ``ucp_request_check_status`` called through ``ctypes.PyDLL`` on the raw
  handles ucxx exposes (``UCXWorker.handle``, ``UCXEndpoint.handle``).

With ``--perftest``, ``ucx_perftest -t tag_lat`` (half a ping-pong, its 50th
percentile; the bench's runner, ``lynx_bench.transport_bench.baselines``) runs after
each size for the physical limit.

    python experiments/ucp_floor.py --messages 300 --rounds 3 --perftest
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import pathlib
import statistics
import struct
import time
from typing import Any

SIZES = (8 << 10, 64 << 10, 1 << 20)
MODES = ("ucxx", "ctypes")
_FULL_MASK = (1 << 64) - 1
_GAP_S = 0.002


def _ucx(tls: str) -> tuple[Any, Any, Any]:
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    import ucxx  # noqa: F401, PLC0415 - lazy, in each process
    import ucxx._lib.libucxx as lib  # noqa: PLC0415

    ctx = lib.UCXContext(config_dict={"TLS": tls, "NET_DEVICES": "all"},
                         feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
    worker = lib.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    return lib, ctx, worker


def _libucp() -> Any:
    import libucx  # noqa: PLC0415 - the wheel ucxx loads libucp from

    so = next(pathlib.Path(next(iter(libucx.__path__))).glob("lib/libucp.so*"))
    ucp = ctypes.PyDLL(str(so))
    v, u64, size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
    ucp.ucp_tag_send_nbx.argtypes, ucp.ucp_tag_send_nbx.restype = [v, v, size, u64, v], v
    ucp.ucp_tag_recv_nbx.argtypes, ucp.ucp_tag_recv_nbx.restype = [v, v, size, u64, u64, v], v
    # ucs_status_t is a packed enum: one byte
    ucp.ucp_request_check_status.argtypes = [v]
    ucp.ucp_request_check_status.restype = ctypes.c_int8
    ucp.ucp_request_free.argtypes = [v]
    ucp.ucp_worker_progress.argtypes, ucp.ucp_worker_progress.restype = [v], ctypes.c_uint
    return ucp


def _receiver(conn: Any, mode: str, size: int, messages: int, tls: str) -> None:
    import numpy as np  # noqa: PLC0415 - in the child

    lib, _ctx, worker = _ucx(tls)
    bufs = [np.ones(size, np.uint8) for _ in range(messages)]  # touched: no page faults
    if mode == "ctypes":
        ucp, param = _libucp(), ctypes.create_string_buffer(256)
        ctypes.c_uint32.from_buffer(param).value = 1 << 16  # UCP_OP_ATTR_FLAG_NO_IMM_CMPL
        wh = worker.handle
        reqs = [ucp.ucp_tag_recv_nbx(wh, b.ctypes.data, size, i + 1, _FULL_MASK,
                                     ctypes.addressof(param)) for i, b in enumerate(bufs)]
    else:
        from ucxx._lib.arr import Array  # noqa: PLC0415

        reqs = [worker.tag_recv(Array(b), lib.UCXXTag(i + 1)) for i, b in enumerate(bufs)]
    conn.send(bytes(worker.address))
    out = []
    for i in range(messages):
        if mode == "ctypes":
            while ucp.ucp_request_check_status(reqs[i]) == 1:  # UCS_INPROGRESS
                ucp.ucp_worker_progress(wh)
            ucp.ucp_request_free(reqs[i])
        else:
            while not reqs[i].completed:
                worker.progress()
        out.append(time.monotonic() - struct.unpack("d", bufs[i][:8].tobytes())[0])
    conn.send(out)


def _run(ctx: Any, mode: str, size: int, messages: int, tls: str) -> tuple[list[float], list[float]]:
    """One block: a fresh receiver and sender; (oneway s, call s) per message."""
    import numpy as np  # noqa: PLC0415

    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(theirs, mode, size, messages, tls))
    child.start()
    lib, _ctx, worker = _ucx(tls)
    try:
        ep = worker.create_endpoint_from_worker_address(
            lib.UCXAddress.create_from_buffer(mine.recv()), False)
        buf = np.ones(size, np.uint8)
        ucp = _libucp() if mode == "ctypes" else None
        param = ctypes.create_string_buffer(256)
        eh, wh = ep.handle, worker.handle
        from ucxx._lib.arr import Array  # noqa: PLC0415

        arr = Array(buf)
        calls = []
        time.sleep(0.2)
        for i in range(messages):
            t0 = time.monotonic()
            buf[:8] = np.frombuffer(struct.pack("d", t0), np.uint8)
            if ucp is not None:
                req = ucp.ucp_tag_send_nbx(eh, buf.ctypes.data, size, i + 1, ctypes.addressof(param))
                calls.append(time.monotonic() - t0)
                if req is not None and req >= (1 << 64) - 100:
                    raise RuntimeError(f"ucp_tag_send_nbx failed: {req - (1 << 64)}")
                while req is not None and ucp.ucp_request_check_status(req) == 1:
                    ucp.ucp_worker_progress(wh)
                if req is not None:
                    ucp.ucp_request_free(req)
            else:
                sreq = ep.tag_send(arr, lib.UCXXTag(i + 1))
                calls.append(time.monotonic() - t0)
                while not sreq.completed:
                    worker.progress()
            until = time.monotonic() + _GAP_S
            while time.monotonic() < until:
                worker.progress()
        oneway = mine.recv()
    finally:
        child.join(30)
    return oneway, calls


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300, help="messages per size per mode per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the modes interleaved")
    parser.add_argument("--tls", default="^posix,sysv", help="UCX_TLS of both sides")
    parser.add_argument("--perftest", action="store_true", help="also run ucx_perftest tag_lat")
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    got: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for _ in range(args.rounds):
        for size in SIZES:
            for mode in MODES:
                oneway, calls = _run(ctx, mode, size, args.messages, args.tls)
                row = got.setdefault((mode, size), ([], []))
                row[0].extend(oneway[10:])  # 10 warm-up messages
                row[1].extend(calls[10:])
    print(f"UCX_TLS={args.tls}; microseconds, median / P99")
    print(f"{'size':>8} {'mode':>7} {'oneway':>16} {'send call':>16}")
    for size in SIZES:
        for mode in MODES:
            oneway, calls = got[(mode, size)]
            print(f"{size >> 10:>6}Ki {mode:>7} {statistics.median(oneway) * 1e6:>7.1f} / "
                  f"{_p(oneway, 0.99) * 1e6:<7.1f} {statistics.median(calls) * 1e6:>7.1f} / "
                  f"{_p(calls, 0.99) * 1e6:<7.1f}")
        ratio = statistics.median(got[("ctypes", size)][0]) / statistics.median(got[("ucxx", size)][0])
        line = f"{size >> 10:>6}Ki oneway ctypes / ucxx {ratio:.2f}"
        if args.perftest:
            from lynx_bench.transport_bench.baselines import ucx_perftest_latency_us  # noqa: PLC0415

            line += f"; ucx_perftest tag_lat {ucx_perftest_latency_us(size, 2000, args.tls):.1f}"
        print(line)


if __name__ == "__main__":
    main()
