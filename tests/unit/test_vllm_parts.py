"""The vLLM connector's parts that need no vLLM: its settings, the scheduler-side plan, the
CPU paged-block layout and the producer's held prefills (Lynx's main environment)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lynx_decode.codec.config import Scheme
from lynx_decode.errors import DecodeError
from lynx_decode.model.protocol import ModelInfo
from lynx_vllm import paged
from lynx_vllm.config import ConnectorConfig
from lynx_vllm.errors import ConnectorError
from lynx_vllm.plan import ConsumerPlan, ProducerPlan, Transfer, producer_params, transfer_of
from lynx_vllm.producer import HeldPrefills

torch = pytest.importorskip("torch")



# -- settings ---------------------------------------------------------------------------------
def test_config_defaults_and_overrides() -> None:
    c = ConnectorConfig.from_extra({}, producer=False)
    assert (c.scheme, c.planes, c.port, c.bandwidth_gbps) == (Scheme.LYNX, (4, 4), 0, None)
    c = ConnectorConfig.from_extra({"port": 14600, "scheme": "INT8", "planes": "3,5", "bandwidth_gbps": 1},
                                   producer=True)
    assert (c.scheme, c.planes, c.port, c.bandwidth_gbps) == (Scheme.INT8, (3, 5), 14600, 1.0)
    assert c.request_codec({"lynx": {"scheme": "lynx", "planes": [2, 2, 4]}}) == (Scheme.LYNX, (2, 2, 4))
    assert c.request_codec(None) == (Scheme.INT8, (3, 5))
    assert c.timeouts().stream_s == 30.0


@pytest.mark.parametrize(("extra", "producer", "message"), [
    ({}, True, "a producer needs a fixed port"),
    ({"port": 1, "colour": "red"}, True, "unknown LynxConnector settings ['colour']"),
    ({"scheme": "int3"}, False, "scheme must be one of"),
    ({"scheme": "fp16"}, False, "use bf16"),
    ({"planes": "4,5"}, False, "planes:"),
    ({"bandwidth_gbps": 0}, False, "bandwidth_gbps must be a positive number"),
    ({"port": 70000}, False, "port must be an int in 0..65535"),
    ({"max_prefills": 0}, False, "max_prefills must be an int >= 1"),
])
def test_config_errors_name_the_key(extra: dict, producer: bool, message: str) -> None:
    with pytest.raises(ConnectorError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ConnectorConfig.from_extra(extra, producer=producer)


# -- the scheduler-side plan --------------------------------------------------------------------
def test_transfer_params_round_trip_and_malformed() -> None:
    params = producer_params(("10.0.0.2", 14600), 1000)
    assert transfer_of(params) == Transfer(("10.0.0.2", 14600), 1000)
    for bad in (None, {}, {"lynx": 3}, {"lynx": {"producer": ["h"], "prompt_tokens": 3}},
                {"lynx": {"producer": ["h", "80"], "prompt_tokens": 3}}, {"lynx": {"producer": ["h", 80]}}):
        assert transfer_of(bad) is None


def test_consumer_loads_all_but_the_last_prompt_token_after_its_local_prefix() -> None:
    plan = ConsumerPlan()
    params = producer_params(("h", 1), 300)
    assert plan.matched("a", params, 300, 0) == 299          # whole blocks and the partial last one
    plan.allocated("a", params, 299)
    spec = plan.take("a", list(range(300)), [7, 3, 9], Scheme.LYNX, (4, 4))
    assert spec is not None and (spec.start, spec.end, spec.block_ids) == (0, 299, (7, 3, 9))
    assert plan.take("a", list(range(300)), [7, 3, 9], Scheme.LYNX, (4, 4)) is None  # once
    assert plan.matched("b", params, 300, 128) == 171       # a local prefix-cache hit of one block
    plan.allocated("b", params, 171)
    spec = plan.take("b", list(range(300)), [1, 2, 3], Scheme.INT8, (4, 4))
    assert spec is not None and (spec.start, spec.end) == (128, 299)
    assert plan.matched("c", params, 301, 0) == 0           # saved for another prompt length
    assert plan.matched("d", None, 300, 0) == 0
    assert plan.matched("e", params, 300, 299) == 0
    plan.allocated("e", params, 0)
    assert plan.pending() == 0


def test_producer_saves_once_when_a_chunked_prefill_completes() -> None:
    plan = ProducerPlan()
    ids = list(range(600))
    assert plan.step("r", prompt_ids=ids, new_blocks=[4, 5], num_computed=0, scheduled=256) is None
    assert plan.step("r", prompt_ids=None, new_blocks=[6, 8], num_computed=256, scheduled=256) is None
    save = plan.step("r", prompt_ids=None, new_blocks=[9], num_computed=512, scheduled=88)
    assert save is not None and save.block_ids == (4, 5, 6, 8, 9) and save.prompt_ids == tuple(ids)
    assert plan.step("r", prompt_ids=None, new_blocks=[], num_computed=600, scheduled=1) is None  # decoding
    assert plan.finished("r") is True
    assert plan.finished("r") is False
    assert plan.step("s", prompt_ids=ids, new_blocks=[1, 2, 3, 4, 5], num_computed=0, scheduled=600) is not None


# -- the CPU paged layout -----------------------------------------------------------------------
def _vec_cache(blocks: int, heads: int, size: int, dim: int) -> torch.Tensor:
    return torch.zeros((blocks, heads, size, 2 * dim), dtype=torch.bfloat16)


def test_vec_layout_holds_k_transposed_then_v() -> None:
    kv = _vec_cache(4, 2, 8, 4)
    k = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4)
    v = -k
    paged.scatter(kv, [2, 0], 6, k, v)  # tokens 6..10: block 2 offsets 6,7 then block 0 offsets 0..2
    cell = kv.view(4, 2, 2, 8 * 4)
    k_block2 = cell[2, :, 0].view(2, 4, 8)        # [heads, dim, block_size]: K transposed
    v_block0 = cell[0, :, 1].view(2, 8, 4)        # [heads, block_size, dim]
    assert torch.equal(k_block2[:, :, 6:8].transpose(1, 2).float(), k[:, 0:2])
    assert torch.equal(v_block0[:, 0:3].float(), v[:, 2:5])
    gk, gv = paged.gather(kv, [2, 0], 6, 11)
    assert torch.equal(gk.float(), k) and torch.equal(gv.float(), v)


def test_gather_scatter_round_trip_over_partial_blocks() -> None:
    rng = np.random.default_rng(0)
    kv = _vec_cache(6, 3, 16, 8)
    k = torch.from_numpy(rng.standard_normal((3, 41, 8), dtype=np.float32)).bfloat16()
    v = torch.from_numpy(rng.standard_normal((3, 41, 8), dtype=np.float32)).bfloat16()
    blocks = [5, 1, 3]
    paged.scatter(kv, blocks, 0, k, v)
    gk, gv = paged.gather(kv, blocks, 0, 41)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    gk, gv = paged.gather(kv, blocks, 17, 30)
    assert torch.equal(gk, k[:, 17:30]) and torch.equal(gv, v[:, 17:30])
    with pytest.raises(ConnectorError, match="need 4 blocks, the request has 3"):
        paged.gather(kv, blocks, 0, 49)


def test_unverified_layouts_are_refused() -> None:
    kv = _vec_cache(2, 2, 16, 8)
    assert paged.check_layout(kv, block_size=16, isa="vec") == (2, 8)
    with pytest.raises(ConnectorError, match="'amx'"):
        paged.check_layout(kv, block_size=16, isa="amx")
    with pytest.raises(ConnectorError, match="unexpected CPU KV cache shape"):
        paged.check_layout(kv, block_size=32, isa="vec")


# -- the producer's held prefills -------------------------------------------------------------
def _info(layers: int = 2) -> ModelInfo:
    return ModelInfo("tiny", layers, 2, 4, 4096, 100, frozenset())


def _save(held: HeldPrefills, ids: list[int], layers: int = 2) -> None:
    held.begin(ids)
    for i in range(layers):
        k = np.full((2, len(ids) - 1, 4), float(i), np.float32)
        held.save_layer(ids, i, k, -k)
    held.finish(ids)


def test_held_prefills_serve_by_prompt_and_drop_the_oldest() -> None:
    held = HeldPrefills(_info(), max_prefills=2, wait_s=0.1)
    for n in (5, 6, 7):
        _save(held, list(range(n)))
    assert len(held) == 2
    p = held.prefill(list(range(7)))
    assert p.token_ids == tuple(range(7)) and p.kv.shape.tokens == 6
    assert float(p.kv.layer(1)[0][0, 0, 0]) == 1.0
    with pytest.raises(DecodeError, match="holds no prefill of the 5-token prompt"):
        held.prefill(list(range(5)))


def test_a_pull_waits_for_a_save_in_progress_and_a_partial_save_is_never_served() -> None:
    held = HeldPrefills(_info(), wait_s=5.0)
    ids = list(range(9))
    held.begin(ids)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(held.prefill(ids)))
    t.start()
    for i in range(2):
        held.save_layer(ids, i, np.zeros((2, 8, 4), np.float32), np.zeros((2, 8, 4), np.float32))
    held.finish(ids)
    t.join(5)
    assert got and got[0].token_ids == tuple(ids)  # type: ignore[attr-defined]
    other = list(range(4))
    held.begin(other)
    held.save_layer(other, 0, np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 4), np.float32))
    with pytest.raises(DecodeError, match=r"missing layers \[1\]"):
        held.finish(other)
    with pytest.raises(DecodeError, match="holds no prefill"):
        HeldPrefills(_info(), wait_s=0.0).prefill(other)


def test_bfloat16_conversions_are_torchs_exactly() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 257, 8)) * rng.choice([1e-30, 1e-3, 1.0, 1e3, 1e37], (3, 257, 8))).astype(np.float32)
    x[0, :4, 0] = [0.0, -0.0, 1.00390625, 1.01171875]  # exact ties: round to even
    kv = _vec_cache(17, 3, 16, 8)
    blocks = list(range(17))
    paged.scatter(kv, blocks, 0, x, -x)
    k, v = paged.gather(kv, blocks, 0, 257)
    want = torch.from_numpy(x).to(torch.bfloat16)
    assert torch.equal(k.view(torch.int16), want.view(torch.int16))
    assert torch.equal(v.view(torch.int16), (-want).view(torch.int16))
    assert np.array_equal(paged.to_float32(k), want.float().numpy())
    half = torch.from_numpy(x[:1, :5]).half()
    assert np.array_equal(paged.to_float32(half), half.float().numpy())
