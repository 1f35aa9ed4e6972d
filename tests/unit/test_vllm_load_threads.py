"""Load threads without vLLM: a real producer (``HeldPrefills`` behind a ``PrefillNode``) and a
real ``KVLoader`` over the in-memory transport, writing into CPU paged blocks laid out as vLLM's,
through :class:`lynx_vllm.load_threads.LoadThreads` (Lynx's main environment).

Asynchronous loads (``load: "async"``), what vLLM's base class asks of an asynchronous connector:
a load is reported finished only once every layer is written, a failure's blocks come with (not
after) its report, an aborted request's load stops writing and is still reported, and nothing
outside the request's own blocks is touched. Synchronous loads (the default): the thread writes
each layer as it lands, ahead of the forward that waits for it, and is out (no write can follow)
once the connector ends the load, whether the load failed or the forward stopped short."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lynx_decode.codec.config import Scheme
from lynx_decode.model.protocol import ModelInfo
from lynx_decode.prefill_node import PrefillNode
from lynx_transport.testing import MemoryTransport, wait_until
from lynx_vllm import paged
from lynx_vllm.config import ConnectorConfig, LoadMode, prepared_forms
from lynx_vllm.consumer import KVLoader
from lynx_vllm.errors import ConnectorError
from lynx_vllm.load_threads import LoadThreads
from lynx_vllm.plan import ConsumerPlan, LoadSpec, Transfer, producer_params
from lynx_vllm.producer import HeldPrefills

torch = pytest.importorskip("torch")

LAYERS, HEADS, DIM, BLOCK = 3, 2, 16, 16
INFO = ModelInfo("tiny-async", LAYERS, HEADS, DIM, 4096, 100, frozenset())
WAIT_S = 10.0  # a bound on things that take milliseconds


# -- settings and the scheduler side ------------------------------------------------------------
def test_load_setting_defaults_to_sync_and_refuses_other_values_naming_the_key() -> None:
    assert ConnectorConfig.from_extra({}, producer=False).load is LoadMode.SYNC
    assert ConnectorConfig.from_extra({"load": "async"}, producer=False).load is LoadMode.ASYNC
    assert ConnectorConfig.from_extra({"load": "sync"}, producer=False).load is LoadMode.SYNC
    for bad in ("Async", "background", 1, True, None, ["async"]):
        with pytest.raises(ConnectorError, match=r"^load must be one of 'sync', 'async'; got "):
            ConnectorConfig.from_extra({"load": bad}, producer=False)


def test_an_async_plan_loads_a_request_once() -> None:
    """A recomputed (failed, recompute policy) or preempted async request comes back with nothing
    computed: it is recomputed locally, not pulled again."""
    params = producer_params(("h", 1), 300)
    plan = ConsumerPlan(once=True)
    assert plan.matched("a", params, 300, 0) == 299
    plan.allocated("a", params, 299)
    spec = plan.take("a", list(range(300)), [7, 3, 9], Scheme.LYNX, (4, 4), own_blocks=[7, 3, 9])
    assert spec is not None and spec.own_blocks == (7, 3, 9)
    assert plan.matched("a", params, 300, 0) == 0
    plan.forget("a")
    assert plan.matched("a", params, 300, 0) == 299
    sync = ConsumerPlan()
    assert sync.matched("b", params, 300, 0) == 299
    sync.allocated("b", params, 299)
    assert sync.take("b", list(range(300)), [1, 2, 3], Scheme.LYNX, (4, 4)) is not None
    assert sync.matched("b", params, 300, 0) == 299  # a synchronous load may be pulled again


def test_a_write_outside_the_blocks_a_load_owns_is_refused_before_anything_is_written() -> None:
    kv = torch.zeros((4, HEADS, BLOCK, 2 * DIM), dtype=torch.bfloat16)
    k = torch.ones((HEADS, 20, DIM))
    with pytest.raises(ConnectorError, match=r"live in blocks \[0\], which the load does not own"):
        paged.scatter(kv, [2, 0], 0, k, k, allowed=[2])
    assert not kv.any()
    paged.scatter(kv, [2, 0], 0, k, k, allowed=[2, 0])
    assert kv[2].all() and kv[0].any() and not kv[1].any() and not kv[3].any()
    assert paged.blocks_of([2, 0, 3], BLOCK, 10, 33) == [2, 0, 3]


# -- the worker side ------------------------------------------------------------------------------
def _ids(n: int, seed: int = 1) -> list[int]:
    return [(i * 31 + seed * 17) % 97 + 2 for i in range(n)]


def _values(ids: list[int], layer: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * layer + len(ids))
    k = rng.standard_normal((HEADS, len(ids) - 1, DIM), dtype=np.float32)
    return k, -2 * k


class Bench:
    """A producer and a consumer's loader on one in-memory transport, vLLM-shaped paged caches, and
    the connector's write (a gate per layer lets a test hold a load thread before a write)."""

    def __init__(self, tmp: Path) -> None:
        self.transport = MemoryTransport()
        # every layer encoded as it is saved into INT8, what these tests' pulls are held in (auto's
        # INT8, and LYNX 4,4 cut from it); a bf16 pull is encoded by the prefill node when it comes
        self.held = HeldPrefills(INFO, wait_s=1.0, prepare=prepared_forms(Scheme.LYNX, (4, 4)))
        self.node = PrefillNode(self.held, transport=self.transport, memory_cache=0)
        self.stats = tmp / "loads.jsonl"
        config = ConnectorConfig.from_extra({"load": "async", "timeout_s": WAIT_S,
                                             "stats_path": str(self.stats)}, producer=False)
        self.loader = KVLoader(INFO, config, transport=self.transport, pool_bytes=16 << 20)
        self.kv = [torch.zeros((16, HEADS, BLOCK, 2 * DIM), dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.gates: dict[int, threading.Event] = {}
        self.written: list[tuple[str, int]] = []
        self.entered: list[tuple[str, int]] = []  # writes begun (a gated one waits after this)
        self.loads = LoadThreads(self.loader, LAYERS, self.write)

    def write(self, spec: LoadSpec, index: int, k: Any, v: Any) -> None:
        self.entered.append((spec.request_id, index))
        gate = self.gates.get(index)
        if gate is not None:
            assert gate.wait(WAIT_S)
        paged.scatter(self.kv[index], spec.block_ids, spec.start, k[:, spec.start : spec.end],
                      v[:, spec.start : spec.end], allowed=spec.own_blocks)
        self.written.append((spec.request_id, index))

    def hold(self, ids: list[int]) -> None:
        self.held.begin(ids)
        for i in range(LAYERS):
            self.held.save_layer(ids, i, *_values(ids, i))
        self.held.finish(ids)

    def spec(self, rid: str, ids: list[int], blocks: list[int], scheme: Scheme = Scheme.BF16,
             start: int = 0) -> LoadSpec:
        return LoadSpec(rid, Transfer(self.node.address, len(ids)), tuple(ids), tuple(blocks), start,
                        len(ids) - 1, scheme, (4, 4), own_blocks=tuple(blocks))

    def collect_until(self, rid: str, finished: set[str] | None = None) -> list[LoadSpec]:
        """collect() until ``rid`` is reported; the failed specs of that call."""
        out: list[list[LoadSpec]] = []

        def reported() -> bool:
            ended, failed = self.loads.collect(finished or ())
            if rid in ended:
                out.append(failed)
                return True
            assert not failed, failed
            return False

        assert wait_until(reported, WAIT_S), f"{rid} was never reported"
        return out[0]

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stats.read_text().splitlines()] if self.stats.is_file() else []

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()
        self.loads.close()
        self.loader.close()
        self.node.close()
        self.held.close()


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    b = Bench(tmp_path)
    yield b
    b.close()


def test_a_load_is_reported_only_once_every_layer_is_written_into_its_own_blocks(bench: Bench) -> None:
    ids = _ids(40)  # 39 tokens: blocks 5, 2 and part of 9
    bench.hold(ids)
    bench.gates[LAYERS - 1] = threading.Event()
    load = bench.loads.submit(bench.spec("r", ids, [5, 2, 9]))
    assert load.mode is LoadMode.ASYNC
    assert wait_until(lambda: ("r", LAYERS - 2) in bench.written, WAIT_S)
    assert bench.loads.collect() == (set(), [])  # the last layer is not written yet: not reported
    bench.gates[LAYERS - 1].set()
    assert bench.collect_until("r") == []
    assert bench.written == [("r", i) for i in range(LAYERS)]
    for i in range(LAYERS):
        k, v = paged.gather(bench.kv[i], [5, 2, 9], 0, 39)
        want_k, want_v = (torch.from_numpy(x).bfloat16() for x in _values(ids, i))
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        untouched = [b for b in range(16) if b not in (5, 2, 9)]
        assert not bench.kv[i][untouched].any()
        assert not bench.kv[i][9, :, :, :].view(HEADS, 2, BLOCK * DIM)[:, 0].view(HEADS, DIM, BLOCK)[:, :, 7:].any()
    [record] = bench.records()
    assert record["load"] == "async" and record["error"] is None
    assert (record["layers_loaded"], record["tokens_loaded"]) == (LAYERS, 39)
    assert record["requested_at"] <= record["last_layer_landed_at"] <= record["written_at"] <= record["reported_at"]
    assert bench.loads.pending() == 0


def test_async_writes_what_a_sync_load_writes(bench: Bench, caplog: pytest.LogCaptureFixture) -> None:
    """LYNX (both planes of every layer): an asynchronous load's blocks = a synchronous load's =
    the loader's own decode; every pull is served from the form the producer encoded as each layer
    was saved, not encoded at the pull."""
    caplog.set_level(logging.INFO, logger="lynx_decode.prefill")
    ids = _ids(70, seed=2)
    bench.hold(ids)
    blocks = [3, 1, 4, 6, 7]
    bench.loads.submit(bench.spec("a", ids, blocks, Scheme.LYNX))
    assert bench.collect_until("a") == []
    written = [kv.clone() for kv in bench.kv]
    for kv in bench.kv:
        kv.zero_()
    job = bench.loads.start(bench.spec("s", ids, blocks, Scheme.LYNX))
    assert all(bench.loads.wait_written(job, i) for i in range(LAYERS))
    bench.loads.end(job)
    bench.loader.finish(job.load)
    direct = bench.loader.start("d", bench.node.address, ids, scheme=Scheme.LYNX, planes=(4, 4))
    for i in range(LAYERS):
        assert torch.equal(bench.kv[i], written[i]), i
        k, v = bench.loader.layer(direct, i)
        mine = torch.zeros_like(bench.kv[i])
        paged.scatter(mine, blocks, 0, k, v)
        assert torch.equal(mine, written[i]), i
    bench.loader.finish(direct)
    assert [r["load"] for r in bench.records()] == ["async", "sync", "sync"]
    served = [m for m in (r.getMessage() for r in caplog.records if r.name == "lynx_decode.prefill")
              if "lynx 4,4" in m]
    assert len(served) == 3 and all("held encoded as it was saved" in m for m in served), served


def test_a_failed_load_is_reported_with_its_blocks_and_writes_nothing(bench: Bench) -> None:
    ids = _ids(30, seed=3)  # never held: the producer refuses the pull
    spec = bench.spec("f", ids, [1, 2])
    bench.loads.submit(spec)
    assert bench.collect_until("f") == [spec]
    assert not any(kv.any() for kv in bench.kv)
    [record] = bench.records()
    assert record["load"] == "async" and "the producer refused" in record["error"]
    assert record["layers_loaded"] == 0


def test_a_write_into_a_block_the_load_does_not_own_fails_the_load(bench: Bench) -> None:
    ids = _ids(40, seed=4)
    bench.hold(ids)
    spec = dataclasses.replace(bench.spec("o", ids, [5, 2, 9]), own_blocks=(5, 2))
    bench.loads.submit(spec)
    assert bench.collect_until("o") == [spec]
    assert not any(kv.any() for kv in bench.kv)
    [record] = bench.records()
    assert "loading layer 0: ConnectorError" in record["error"] and "does not own" in record["error"]


def test_an_aborted_requests_load_stops_writing_and_is_still_reported(bench: Bench) -> None:
    """vLLM frees an aborted async request's blocks only once get_finished names it; the load must
    stop writing them first."""
    ids = _ids(40, seed=5)
    bench.hold(ids)
    bench.gates[1] = threading.Event()
    bench.loads.submit(bench.spec("x", ids, [5, 2, 9]))
    assert wait_until(lambda: ("x", 0) in bench.written, WAIT_S)
    assert bench.loads.collect({"x"}) == (set(), [])  # cancelled; its thread is still in its write
    bench.gates[1].set()  # the write under way finishes; no later layer is written
    assert bench.collect_until("x") == []  # reported, not as a failure: the request is gone
    assert bench.written == [("x", 0), ("x", 1)]
    assert not bench.kv[2].any()
    [record] = bench.records()
    assert "vLLM finished the request before its load" in record["error"]


# -- synchronous loads ----------------------------------------------------------------------------
def test_a_sync_load_writes_each_layer_as_it_lands_ahead_of_the_forward(bench: Bench) -> None:
    """The cause of the forward's short wait: the thread writes the later layers while the forward
    is still at layer 0 (it asks for no layer past it here), and the load is reported only by the
    connector, not on the asynchronous queue."""
    ids = _ids(40, seed=6)
    bench.hold(ids)
    job = bench.loads.start(bench.spec("s", ids, [5, 2, 9]))
    assert job.load.mode is LoadMode.SYNC
    assert bench.loads.wait_written(job, 0)
    assert wait_until(lambda: job.written == LAYERS, WAIT_S)  # no wait_written past layer 0
    assert bench.written == [("s", i) for i in range(LAYERS)]
    bench.loads.end(job)
    assert job.out and not job.load.failed
    assert bench.loads.collect() == (set(), []) and bench.loads.pending() == 0
    record = bench.loader.finish(job.load)
    assert record["load"] == "sync" and record["error"] is None and record["layers_loaded"] == LAYERS
    for i in range(LAYERS):
        k, _ = paged.gather(bench.kv[i], [5, 2, 9], 0, 39)
        assert torch.equal(k, torch.from_numpy(_values(ids, i)[0]).bfloat16())


def test_a_failed_sync_load_answers_false_at_once_and_writes_nothing(bench: Bench) -> None:
    job = bench.loads.start(bench.spec("f", _ids(30, seed=7), [1, 2]))  # never held: refused
    assert not bench.loads.wait_written(job, 0)
    assert not bench.loads.wait_written(job, LAYERS - 1)
    bench.loads.end(job)
    assert job.out and "the producer refused" in str(job.load.error)
    assert not any(kv.any() for kv in bench.kv)


def test_ending_a_sync_load_short_of_its_last_layer_stops_its_thread_before_end_returns(bench: Bench) -> None:
    """A forward that stops short (vLLM's wait_for_save with the load still active): the thread is
    cancelled, the write under way finishes, and no later layer is written after end() returns,
    since vLLM may hand the blocks to another request once it hears of the failure."""
    ids = _ids(40, seed=8)
    bench.hold(ids)
    bench.gates[1] = threading.Event()
    job = bench.loads.start(bench.spec("e", ids, [5, 2, 9]))
    assert bench.loads.wait_written(job, 0)
    assert wait_until(lambda: ("e", 1) in bench.entered, WAIT_S)
    ender = threading.Thread(target=bench.loads.end, args=(job,))
    ender.start()
    ender.join(0.2)
    assert ender.is_alive()  # end() waits for the thread, which is inside its write of layer 1
    bench.gates[1].set()
    ender.join(WAIT_S)
    assert not ender.is_alive() and job.out
    assert bench.written == [("e", 0), ("e", 1)]
    assert not bench.kv[2].any()
    assert "the forward ended before the load's last layer" in str(job.load.error)
