"""The vLLM connector's parts that need no vLLM: its settings, the scheduler-side plan, the
CPU paged-block layout and the producer's held prefills (Lynx's main environment)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.errors import DecodeError
from lynx_decode.kvencode import EncodedSource, encode_cache
from lynx_decode.model.protocol import ModelInfo
from lynx_transport.config import TransportConfig
from lynx_vllm import paged
from lynx_vllm.config import NO_SPLIT_IN_VLLM, ConnectorConfig, prepared_forms, resolve_split
from lynx_vllm.errors import ConnectorError
from lynx_vllm.plan import (
    REMOTE_DECODE,
    ConsumerPlan,
    ProducerPlan,
    Transfer,
    producer_params,
    remote_decode,
    transfer_of,
)
from lynx_vllm.producer import HeldPrefills

torch = pytest.importorskip("torch")



# -- settings ---------------------------------------------------------------------------------
def test_config_defaults_and_overrides() -> None:
    c = ConnectorConfig.from_extra({}, producer=False)
    assert (c.scheme, c.planes, c.port, c.bandwidth_gbps) == (Scheme.LYNX, "auto", 0, None)
    c = ConnectorConfig.from_extra({"port": 14600, "scheme": "INT8", "planes": "3,5", "bandwidth_gbps": 1},
                                   producer=True)
    assert (c.scheme, c.planes, c.port, c.bandwidth_gbps) == (Scheme.INT8, (3, 5), 14600, 1.0)
    assert c.request_codec({"lynx": {"scheme": "lynx", "planes": [2, 2, 4]}}) == (Scheme.LYNX, (2, 2, 4))
    assert c.request_codec(None) == (Scheme.INT8, (3, 5))
    assert c.timeouts().stream_s == 30.0


def test_ucx_settings_reach_the_transport_and_default_to_its_own() -> None:
    """On an emulated link the cache must cross the link's device: the transport hands its
    UCX context these settings, which win over UCX_* variables (so the environment cannot)."""
    default = ConnectorConfig.from_extra({}, producer=False).transport_config()
    assert (default.ucx_tls, default.ucx_net_devices) == (TransportConfig().ucx_tls, TransportConfig().ucx_net_devices)
    pinned = ConnectorConfig.from_extra({"port": 1, "ucx_tls": "tcp", "ucx_net_devices": "lynxvb-tx0"},
                                        producer=True).transport_config()
    assert (pinned.ucx_tls, pinned.ucx_net_devices) == ("tcp", "lynxvb-tx0")


@pytest.mark.parametrize(("extra", "producer", "message"), [
    ({}, True, "a producer needs a fixed port"),
    ({"port": 1, "colour": "red"}, True, "unknown LynxConnector settings ['colour']"),
    ({"scheme": "int3"}, False, "scheme must be one of"),
    ({"scheme": "fp16"}, False, "use bf16"),
    ({"planes": "4,5"}, False, "planes:"),
    ({"bandwidth_gbps": 0}, False, "bandwidth_gbps must be a positive number"),
    ({"port": 70000}, False, "port must be an int in 0..65535"),
    ({"max_prefills": 0}, False, "max_prefills must be an int >= 1"),
    ({"ucx_tls": ""}, False, "ucx_tls must be a non-empty string"),
    ({"ucx_net_devices": 3}, False, "ucx_net_devices must be a non-empty string"),
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
    assert plan.step("r", prompt_ids=ids, new_blocks=[4, 5], num_computed=0, scheduled=256,
                     params=REMOTE_DECODE) is None
    assert plan.step("r", prompt_ids=None, new_blocks=[6, 8], num_computed=256, scheduled=256) is None
    save = plan.step("r", prompt_ids=None, new_blocks=[9], num_computed=512, scheduled=88)
    assert save is not None and save.block_ids == (4, 5, 6, 8, 9) and save.prompt_ids == tuple(ids)
    assert plan.step("r", prompt_ids=None, new_blocks=[], num_computed=600, scheduled=1) is None  # decoding
    assert plan.finished("r") is True
    assert plan.finished("r") is False
    assert plan.step("s", prompt_ids=ids, new_blocks=[1, 2, 3, 4, 5], num_computed=0, scheduled=600,
                     params={"do_remote_decode": True}) is not None


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": False}, {"do_remote_prefill": True},
                                    {"do_remote_decode": "yes"}])
def test_producer_saves_only_requests_sent_for_a_remote_decode(params: dict | None) -> None:
    """vLLM's convention: a proxy's prefill leg says do_remote_decode; any other request (a user
    talking to the producer directly, a consumer's leg sent to the wrong server) is not held."""
    plan = ProducerPlan()
    ids = list(range(300))
    assert plan.step("r", prompt_ids=ids, new_blocks=[1, 2, 3], num_computed=0, scheduled=300, params=params) is None
    assert plan.step("r", prompt_ids=None, new_blocks=[], num_computed=300, scheduled=1) is None
    assert plan.finished("r") is False  # so its finished request returns no kv_transfer_params
    assert remote_decode(params) is False
    assert remote_decode(REMOTE_DECODE) and dict(REMOTE_DECODE) == {"do_remote_decode": True,
                                                                   "do_remote_prefill": False}


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
    with pytest.raises(ConnectorError, match="'amx' and was not probed"):
        paged.check_layout(kv, block_size=16, isa="amx")
    with pytest.raises(ConnectorError, match="unexpected CPU KV cache shape"):
        paged.check_layout(kv, block_size=32, isa="vec")


def _interleaving_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slots: torch.Tensor) -> None:
    """A stand-in for a kernel's cache write in a layout of its own (pairs of tokens interleaved
    per dimension, as AMX's bf16 tiles pair them): K and V of token ``t``, dim ``d`` of a cell at
    ``(t // 2) * 2 * head_size + 2 * d + t % 2``."""
    _, heads, size, dim = key_cache.shape
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, size)
        where = (t // 2) * 2 * dim + 2 * torch.arange(dim) + t % 2
        for cache, x in ((key_cache, key), (value_cache, value)):
            for h in range(heads):
                cache[b, h].view(size * dim)[where] = x[i, h]


def test_a_probed_layout_reads_and_writes_what_the_kernel_wrote() -> None:
    # the layout measured with the kernel's own write (here a stand-in of AMX's interleaving):
    # what the write put in a block, gather reads back; what scatter writes, the write would have
    layout = paged.probe_layout("amx", 16, 8, torch.bfloat16, _interleaving_write)
    assert layout.k_pos[1, 0] == 1 and layout.k_pos[0, 1] == 2 and layout.v_pos[2, 0] == 16
    kv = _vec_cache(3, 2, 16, 8)
    assert paged.check_layout(kv, block_size=16, isa="amx", layout=layout) == (2, 8)
    rng = np.random.default_rng(1)
    k = torch.from_numpy(rng.standard_normal((2, 20, 8), dtype=np.float32)).bfloat16()
    v = torch.from_numpy(rng.standard_normal((2, 20, 8), dtype=np.float32)).bfloat16()
    by_kernel = _vec_cache(3, 2, 16, 8)
    cells = by_kernel.view(3, 2, 32, 8)
    _interleaving_write(k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), cells[:, :, :16],
                        cells[:, :, 16:], torch.tensor([2 * 16 + t for t in range(16)] + [t for t in range(4)]))
    gk, gv = paged.gather(by_kernel, [2, 0], 0, 20, layout)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    paged.scatter(kv, [2, 0], 0, k, v, layout=layout)
    assert torch.equal(kv, by_kernel)
    # a write that loses values is no permutation: refused
    with pytest.raises(ConnectorError, match="not store a block's K as a permutation"):
        paged.probe_layout("odd", 16, 8, torch.bfloat16, lambda key, value, kc, vc, slots: None)


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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_prefill_no_consumer_pulls_for_hold_s_is_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lynx_vllm")
    clock = Clock()
    held = HeldPrefills(_info(), hold_s=60.0, wait_s=0.0, clock=clock)
    pulled, unpulled = list(range(10)), list(range(20))
    held.begin(pulled, "cmpl-a")
    for i in range(2):
        held.save_layer(pulled, i, np.zeros((2, 9, 4), np.float32), np.zeros((2, 9, 4), np.float32))
    held.finish(pulled)
    _save(held, unpulled)
    clock.now += 30
    assert held.prefill(pulled).token_ids == tuple(pulled)  # a pull restarts its wait
    clock.now += 29.9
    assert held.expire() == 0 and len(held) == 2
    clock.now += 0.1  # 60 s since the unpulled one was published
    assert held.expire() == 1 and len(held) == 1
    [drop] = caplog.records
    assert drop.levelno == logging.WARNING and drop.name == "lynx_vllm"
    assert drop.getMessage() == ("dropped the held cache of a request (20 prompt tokens, no consumer "
                                 "pulled it): held for hold_s=60 s since it was published")
    with pytest.raises(DecodeError, match="do_remote_decode: true.*unpulled for hold_s=60 s"):
        held.prefill(unpulled)
    clock.now += 30  # 60 s since the last pull: the pull itself expires it first
    with pytest.raises(DecodeError, match="holds no prefill of the 10-token prompt"):
        held.prefill(pulled)
    assert len(held) == 0
    drop = caplog.records[-1]
    assert drop.levelno == logging.INFO
    assert drop.getMessage() == ("dropped the held cache of request cmpl-a (10 prompt tokens, pulled 1 time(s)): "
                                 "held for hold_s=60 s since it was last pulled")


def test_past_max_prefills_the_least_recently_used_is_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lynx_vllm")
    clock = Clock()
    held = HeldPrefills(_info(), max_prefills=2, hold_s=60.0, wait_s=0.0, clock=clock)
    _save(held, list(range(5)))
    _save(held, list(range(6)))
    held.prefill(list(range(5)))  # now the 6-token one is the least recently used
    _save(held, list(range(7)))
    held.prefill(list(range(5)))
    held.prefill(list(range(7)))
    with pytest.raises(DecodeError, match="past max_prefills=2"):
        held.prefill(list(range(6)))
    [drop] = caplog.records
    assert drop.levelno == logging.WARNING
    assert drop.getMessage().endswith("(6 prompt tokens, no consumer pulled it): max_prefills=2 more recently used "
                                      "prefills are held")


def test_hold_s_setting() -> None:
    assert ConnectorConfig.from_extra({}, producer=False).hold_s == 60.0
    assert ConnectorConfig.from_extra({"port": 1, "hold_s": 5}, producer=True).hold_s == 5.0
    with pytest.raises(ConnectorError, match="hold_s must be a positive number"):
        ConnectorConfig.from_extra({"hold_s": 0}, producer=False)


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


# -- auto split and the forms prepared at save -------------------------------------------------
def test_auto_is_the_default_split_and_pulls_int8_in_vllm() -> None:
    # a vLLM consumer reads a layer once every plane of it landed, so auto splits nothing,
    # and the record's reason says so
    assert ConnectorConfig.from_extra({}, producer=False).planes == "auto"
    assert resolve_split(Scheme.LYNX, "auto") == (Scheme.INT8, (4, 4), NO_SPLIT_IN_VLLM)
    assert NO_SPLIT_IN_VLLM.startswith("int8 (no split)")
    # a given split, or another scheme, is taken as it is
    assert resolve_split(Scheme.LYNX, (2, 2, 4)) == (Scheme.LYNX, (2, 2, 4), None)
    assert resolve_split(Scheme.BF16, "auto") == (Scheme.BF16, (4, 4), None)
    assert ConnectorConfig.from_extra({"planes": "AUTO"}, producer=False).planes == "auto"


def test_the_producer_prepares_what_its_consumers_are_configured_to_pull() -> None:
    assert prepared_forms(Scheme.LYNX, "auto") == (CodecConfig(Scheme.INT8),)
    # a split is held as its INT8 codes: the prefill node cuts the planes as it sends them
    assert prepared_forms(Scheme.LYNX, (2, 2, 4)) == (CodecConfig(Scheme.INT8),)
    assert prepared_forms(Scheme.BF16, "auto") == (CodecConfig(Scheme.BF16),)


def test_held_prefills_encode_each_layer_as_it_is_saved() -> None:
    forms = (CodecConfig(Scheme.INT8), CodecConfig(Scheme.LYNX, planes=(4, 4)), CodecConfig(Scheme.LYNX, planes=(3, 5)))
    held = HeldPrefills(_info(layers=3), prepare=forms, wait_s=0.1)
    try:
        assert isinstance(held, EncodedSource)
        ids = list(range(40))
        rng = np.random.default_rng(1)
        held.begin(ids)
        for i in range(3):
            k = rng.standard_normal((2, len(ids) - 1, 4)).astype(np.float32)
            held.save_layer(ids, i, k, k * 0.5)
        held.finish(ids)
        prefill = held.prefill(ids)
        for form in forms:  # each form byte for byte what encoding the whole prefill gives
            got = held.encoded(ids, form)
            assert got is not None and got.config == form
            want = encode_cache(prefill, _info(layers=3).layers, form)
            for a, b in zip(got.layers, want.layers):
                assert a.buffers.keys() == b.buffers.keys()
                for p in a.buffers:
                    assert np.array_equal(np.asarray(a.buffers[p]), np.asarray(b.buffers[p]))
        # a form not prepared: None (the prefill node encodes it), and that ask counts no pull
        assert held.encoded(ids, CodecConfig(Scheme.INT4)) is None
        assert held.held_bytes == prefill.kv.keys.nbytes + prefill.kv.values.nbytes + sum(
            e.nbytes for e in (held.encoded(ids, f) for f in forms) if e is not None)
    finally:
        held.close()
