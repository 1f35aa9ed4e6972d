"""An asynchronous configuration's unloaded TPOT in ``make vllm-bench`` (:mod:`lynx_bench.vllm.bench`):
the same consumer decoding with no load beside it, measured before the loaded run, with nothing
else running (``idle``) and with the producer prefilling other prompts at the run's rate
(``beside_prefills``): where producer and consumer share the cores (``--no-pin``; the benchmark
gives each cores of its own otherwise), the second is the loaded run's CPU without its loads, the
reference its TPOT p99 is judged against; pinned apart, the two should agree."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from lynx_bench.common.errors import VllmNodeError
from lynx_bench.vllm.bench_servers import Server
from lynx_bench.vllm.bench_session import Bench, say
from lynx_bench.vllm.bench_summary import BenchConfig, metric

__all__ = ["BESIDE_SEED", "UNLOADED_REQUESTS", "UNLOADED_SEED", "prefills_beside", "unloaded_tpot"]

#: An asynchronous configuration's unloaded TPOT: this many requests, one at a time, on prompts
#: of the run's seed plus :data:`UNLOADED_SEED`, with nothing beside them and again with the
#: producer prefilling other prompts (seed plus :data:`BESIDE_SEED` on) at the run's rate.
UNLOADED_REQUESTS = 4
UNLOADED_SEED = 1000
BESIDE_SEED = 2000


def unloaded_tpot(bench: Bench, c: BenchConfig, name: str, endpoint: Server, align: Server, prefill: Server,
                   rate: float, run_dir: Path) -> dict[str, dict[str, float | None]] | None:
    """For an asynchronous configuration, the same consumer's TPOT with no load beside it:
    :data:`UNLOADED_REQUESTS` requests one at a time through the same endpoint, on prompts of
    another seed (so the measured run's prompts get no prefix-cache hit from them), ``idle`` with
    nothing else running and ``beside_prefills`` with the producer prefilling other prompts at the
    run's ``rate`` meanwhile (:func:`prefills_beside`): on a host where producer and consumer share
    the cores, that is the measured run's CPU without its loads. None for the other configurations."""
    if c.load != "async":
        return None
    out: dict[str, dict[str, float | None]] = {}
    for cond in ("idle", "beside_prefills"):
        say(f"{name}: unloaded TPOT ({cond}), {UNLOADED_REQUESTS} requests one at a time")
        beside = prefills_beside(bench, prefill, rate, name) if cond == "beside_prefills" else contextlib.nullcontext()
        with beside:
            # not f"{name}-...": the measured run's records are told apart by that prefix
            result = bench.benchmark(endpoint.url, align.url, math.inf, f"unloaded.{cond}.{name}-", run_dir,
                                     requests=UNLOADED_REQUESTS, seed=bench.args.seed + UNLOADED_SEED,
                                     max_concurrency=1, name=f"unloaded-{cond}")
        tpot = metric(result, "tpot")
        out[cond] = {"median": tpot["median"], "p99": tpot["p99"]}
    return out


@contextlib.contextmanager
def prefills_beside(bench: Bench, prefill: Server, rate: float, name: str) -> Iterator[None]:
    """While the block runs, a thread asks ``prefill`` (the producer itself, not the proxy: nothing is
    held or pulled) for one-token completions of fresh prompts of the run's length, one every
    ``1/rate`` s (or at once when one took longer), so the producer prefills as it does in the run;
    the prefill under way when the block ends is waited for."""
    stop = threading.Event()
    failed: list[str] = []

    def loop() -> None:
        start, k = time.monotonic(), 0
        while not stop.is_set():
            ids = bench.prompt_ids(bench.args.prompt_tokens, bench.args.seed + BESIDE_SEED + k)
            try:
                bench.complete(prefill.url, ids, 1, f"beside.{name}.{k}")
            except VllmNodeError as exc:
                failed.append(str(exc))
                return
            k += 1
            stop.wait(max(0.0, start + k / rate - time.monotonic()))

    thread = threading.Thread(target=loop, name="lynx-vllm-bench-prefills-beside", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if failed:
        raise VllmNodeError(f"{name}: a prefill beside the unloaded requests failed: {failed[0]}")
