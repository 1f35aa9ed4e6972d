"""`lynx load`'s pure logic (lynx_bench.load.logic, .results, .report): arrivals, rates, rows, percentiles,
the summary and load.json. No sockets, no processes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from lynx_bench.common.stats import percentile
from lynx_bench.load.logic import (
    LoadConfig,
    ModelShape,
    job_split,
    load_for_rate,
    lynx_split,
    poisson_arrivals,
    prompt_set,
    rate_for_load,
    request_bytes,
    split_label,
)
from lynx_bench.load.report import ratio_table, read_load_json, summary_table, write_load_json
from lynx_bench.load.results import (
    REQUEST_FIELDS,
    SUMMARY_FIELDS,
    RequestRow,
    Status,
    peak_egress_gbps,
    request_row,
    summarize,
)
from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.codec.layout import CacheLayout, LayerLayout
from lynx_decode.kvheader import KVHeader
from lynx_transport.errors import ConfigError

SMOLLM2 = ModelShape(layers=30, kv_heads=3, head_dim=64, vocab=49152, max_positions=8192)


# -- arrivals ------------------------------------------------------------------------------------

def test_arrivals_are_seeded_and_reproducible() -> None:
    a = poisson_arrivals(2.0, 50, seed=7, decode_nodes=3, prompts=3)
    assert a == poisson_arrivals(2.0, 50, seed=7, decode_nodes=3, prompts=3)
    assert a != poisson_arrivals(2.0, 50, seed=8, decode_nodes=3, prompts=3)
    times = [x.arrival_s for x in a]
    assert times == sorted(times) and times[0] > 0
    assert [x.index for x in a] == list(range(50))


def test_arrivals_at_two_rates_are_the_same_schedule_stretched() -> None:
    slow = poisson_arrivals(1.0, 40, seed=3, decode_nodes=2, prompts=3)
    fast = poisson_arrivals(4.0, 40, seed=3, decode_nodes=2, prompts=3)
    for s, f in zip(slow, fast):
        assert f.arrival_s == pytest.approx(s.arrival_s / 4.0)
        assert (f.decode_node, f.prompt_id) == (s.decode_node, s.prompt_id)


def test_arrivals_mean_interval_is_one_over_rate() -> None:
    rate = 5.0
    times = np.array([x.arrival_s for x in poisson_arrivals(rate, 20000, seed=1)])
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std == mean
    assert (gaps > 0).all()


def test_arrivals_spread_over_nodes_and_prompts() -> None:
    a = poisson_arrivals(1.0, 300, seed=0, decode_nodes=3, prompts=3)
    assert [x.decode_node for x in a[:6]] == [0, 1, 2, 0, 1, 2]
    counts = np.bincount([x.prompt_id for x in a], minlength=3)
    assert counts.min() > 60 and counts.sum() == 300


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_arrivals_reject_a_bad_rate(rate: float) -> None:
    with pytest.raises(ConfigError, match="rate"):
        poisson_arrivals(rate, 3, seed=0)


def test_prompt_set_is_seeded_ids_in_the_vocabulary() -> None:
    p = prompt_set(0, 3, 128, 1000)
    assert len(p) == 3 and all(len(x) == 128 for x in p)
    assert all(0 <= t < 1000 for x in p for t in x)
    assert p == prompt_set(0, 3, 128, 1000) and p != prompt_set(1, 3, 128, 1000)
    assert p[0] != p[1]


# -- bytes and rates -----------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["bf16", "int8", "int4", "lynx"])
def test_request_bytes_equal_the_kv_streams_regions(scheme: str) -> None:
    tokens = 512
    s = Scheme(scheme)
    layer = LayerLayout.build(CodecConfig(scheme=s), SMOLLM2.kv_heads, tokens - 1, SMOLLM2.head_dim)
    header = KVHeader("r", "m", s, tokens, 0.0, CacheLayout.of([layer] * SMOLLM2.layers))
    lanes: dict[int, int] = {}
    for _name, nbytes, lane in header.regions():
        lanes[lane] = lanes.get(lane, 0) + nbytes
    anchor, residual = request_bytes(SMOLLM2, scheme, tokens)
    assert (anchor, residual) == (lanes[0], lanes.get(1, 0))
    assert (residual > 0) == (s is Scheme.LYNX)


@pytest.mark.parametrize("planes", [(3, 5), (2, 2, 4)])
def test_request_bytes_of_a_split_equal_its_kv_streams_regions(planes: tuple[int, ...]) -> None:
    tokens = 512
    layer = LayerLayout.build(CodecConfig(scheme=Scheme.LYNX, planes=planes), SMOLLM2.kv_heads, tokens - 1,
                              SMOLLM2.head_dim)
    header = KVHeader("r", "m", Scheme.LYNX, tokens, 0.0, CacheLayout.of([layer] * SMOLLM2.layers))
    lanes: dict[int, int] = {}
    for _name, nbytes, lane in header.regions():
        lanes[lane] = lanes.get(lane, 0) + nbytes
    anchor, residual = request_bytes(SMOLLM2, "lynx", tokens, planes)
    assert (anchor, residual) == (lanes[0], sum(n for lane, n in lanes.items() if lane > 0))
    assert len(lanes) == len(planes)
    assert anchor < request_bytes(SMOLLM2, "lynx", tokens)[0]  # fewer anchor bits than 4,4


def test_lynx_carries_the_int8_bytes_split_in_two() -> None:
    int8 = request_bytes(SMOLLM2, "int8", 4096)
    lynx = request_bytes(SMOLLM2, "lynx", 4096)
    int4 = request_bytes(SMOLLM2, "int4", 4096)
    assert int8[1] == 0 and lynx[1] > 0
    assert lynx[0] == int4[0] < int8[0]
    # the split costs alignment padding only
    assert 0 <= sum(lynx) - sum(int8) < SMOLLM2.layers * 256
    layer = LayerLayout.build(CodecConfig(scheme=Scheme.INT8), 3, 4095, 64)
    assert int8[0] == 4 * 4096 + 30 * layer.plane_size(0)


def test_rate_from_load() -> None:
    # 1 Gbit/s, 50 MB per request: 2.5 requests/s fill the link
    assert rate_for_load(1.0, 1.0, 50_000_000) == pytest.approx(2.5)
    assert rate_for_load(0.8, 1.0, 50_000_000) == pytest.approx(2.0)
    assert rate_for_load(0.5, 10.0, 50_000_000) == pytest.approx(12.5)
    assert load_for_rate(2.0, 1.0, 50_000_000) == pytest.approx(0.8)
    for load in (0.1, 0.5, 0.95):
        assert load_for_rate(rate_for_load(load, 2.0, 123_457), 2.0, 123_457) == pytest.approx(load)


# -- percentiles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 200])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(n: int, q: float) -> None:
    values = np.random.default_rng(n).standard_exponential(n)
    assert percentile(values.tolist(), q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # sorts its input
    with pytest.raises(ValueError):
        percentile([1.0], 101)


# -- rows and the summary ------------------------------------------------------------------------

def _sink_result(rid: str, sent: float, anchor: float | None, full: float | None,
                 status: Status = Status.COMPLETED, nbytes: tuple[int, int] = (600, 400)) -> dict:
    return {"request_id": rid, "status": status.value, "sent_unix": sent, "scheduled_unix": sent,
            "anchor_unix": None if anchor is None else sent + anchor,
            "full_unix": None if full is None else sent + full,
            "bytes_anchor": nbytes[0], "bytes_residual": nbytes[1], "error": None}


def test_request_row_sink_lynx_ttft_is_the_anchor_lane() -> None:
    row = request_row("lynx", 0.8, 2, 1000.0, _sink_result("a", 1001.5, 0.25, 0.5))
    assert tuple(dataclasses.asdict(row)) == REQUEST_FIELDS
    assert row.arrival_s == pytest.approx(1.5)
    assert row.ttft_s == pytest.approx(0.25) and row.time_to_anchor_s == pytest.approx(0.25)
    assert row.ttfct_s == pytest.approx(0.5) and row.time_to_full_s == pytest.approx(0.5)
    assert row.e2e_s is None and row.decode_node == 2 and row.status == "completed"


def test_request_row_of_a_lynx_request_run_as_int8_waits_for_the_whole_cache() -> None:
    # --planes auto chose no split: the sink asked for INT8; the row keeps the phase's scheme
    result = {**_sink_result("a", 1000.0, 0.4, 0.41, nbytes=(1000, 0)), "scheme": "int8", "planes": None}
    row = request_row("lynx", 0.8, 0, 1000.0, result)
    assert row.scheme == "lynx"
    assert row.ttft_s == pytest.approx(0.41) == row.ttfct_s == row.time_to_full_s
    split = {**_sink_result("b", 1000.0, 0.2, 0.41), "scheme": "lynx", "planes": [4, 4]}
    assert request_row("lynx", 0.8, 0, 1000.0, split).ttft_s == pytest.approx(0.2)


def test_request_row_sink_int8_ttft_is_the_whole_cache() -> None:
    row = request_row("int8", 0.8, 0, 1000.0, _sink_result("a", 1000.0, 0.4, 0.41, nbytes=(1000, 0)))
    assert row.ttft_s == pytest.approx(0.41) == row.ttfct_s
    assert row.time_to_anchor_s == pytest.approx(0.4)


def test_request_row_model_takes_the_from_request_times() -> None:
    result = {"request_id": "m", "status": "completed", "sent_unix": 10.0, "ttft_s": 0.3, "ttfct_s": 0.6,
              "e2e_s": 2.0, "time_to_anchor_s": 0.2, "time_to_full_s": 0.5, "bytes_anchor": 5,
              "bytes_residual": 4}
    row = request_row("lynx", 0.5, 1, 9.0, result)
    assert (row.ttft_s, row.ttfct_s, row.e2e_s, row.time_to_anchor_s, row.time_to_full_s) == \
        (0.3, 0.6, 2.0, 0.2, 0.5)
    assert row.arrival_s == pytest.approx(1.0)


def test_request_row_of_a_failed_or_unsent_request() -> None:
    failed = request_row("int8", 0.5, 0, 0.0, _sink_result("f", 1.0, None, None, Status.BUSY))
    assert failed.status == "busy" and failed.ttft_s is None and failed.time_to_full_s is None
    unsent = request_row("int8", 0.5, 0, 0.0, {"request_id": "u", "status": "timeout", "sent_unix": None})
    assert unsent.status == "timeout" and unsent.arrival_s is None and unsent.bytes_anchor is None
    with pytest.raises(ValueError):
        request_row("int8", 0.5, 0, 0.0, {"request_id": "x", "status": "lost", "sent_unix": 1.0})


def _rows() -> list[RequestRow]:
    rows = []
    # lynx at 0.8: 10 requests one per second, anchors after 0.1*(i+1), full 0.2*(i+1); #9 failed
    for i in range(10):
        status = Status.FAILED if i == 9 else Status.COMPLETED
        rows.append(request_row("lynx", 0.8, i % 2, 0.0,
                                _sink_result(f"l{i}", float(i), 0.1 * (i + 1),
                                             None if i == 9 else 0.2 * (i + 1), status)))
    for i in range(4):
        rows.append(request_row("int8", 0.8, 0, 0.0, _sink_result(f"i{i}", float(i), 0.5, 0.5,
                                                                  nbytes=(1000, 0))))
    rows.append(request_row("int8", 0.8, 0, 0.0, _sink_result("i4", 4.0, None, None, Status.TIMEOUT)))
    return rows


def test_summary_counts_failed_requests_and_takes_percentiles_of_the_completed() -> None:
    summary = summarize(_rows(), bandwidth_gbps=1e-6)  # 1 kbit/s: utilization readable
    assert [(s.scheme, s.load) for s in summary] == [("lynx", 0.8), ("int8", 0.8)]
    lynx, int8 = summary
    assert tuple(dataclasses.asdict(lynx)) == SUMMARY_FIELDS
    assert (lynx.requests, lynx.completed, lynx.failed) == (10, 9, 1)
    assert (int8.requests, int8.completed, int8.failed) == (5, 4, 1)
    anchors = [0.1 * (i + 1) for i in range(9)]
    assert lynx.p50_ttft_s == pytest.approx(np.percentile(anchors, 50))
    assert lynx.p90_ttft_s == pytest.approx(np.percentile(anchors, 90))
    assert lynx.p99_ttft_s == pytest.approx(np.percentile(anchors, 99))
    fulls = [0.2 * (i + 1) for i in range(9)]
    assert lynx.p50_ttfct_s == pytest.approx(np.percentile(fulls, 50))
    assert lynx.p99_full_s == pytest.approx(np.percentile(fulls, 99)) == lynx.p99_ttfct_s
    assert int8.p99_ttft_s == pytest.approx(0.5) == int8.p99_full_s
    # int8: 4 x 1000 bytes from t=0 to the last completion at 3.5 s, on a 1 kbit/s link
    assert int8.link_utilization == pytest.approx(4 * 1000 * 8 / (1e3 * 3.5))
    # lynx: 9 x 1000 bytes completed; span from 0 to 8 + 1.8 = 9.8 s
    assert lynx.link_utilization == pytest.approx(9 * 1000 * 8 / (1e3 * 9.8))


def test_summary_of_a_phase_where_nothing_completed() -> None:
    rows = [request_row("int4", 0.95, 0, 0.0, _sink_result("x", 1.0, None, None, Status.FAILED))]
    (s,) = summarize(rows, 1.0)
    assert (s.requests, s.completed, s.failed) == (1, 0, 1)
    assert s.p50_ttft_s is None and s.p99_full_s is None and s.link_utilization is None
    assert "0/1" in summary_table([s])


def test_tables_show_every_phase() -> None:
    summary = summarize(_rows(), 1.0)
    text = summary_table(summary)
    assert "p99_ttft" in text and "lynx" in text and "int8" in text and "9/10" in text
    named = summary_table(summary, {"lynx": "lynx int8"}).splitlines()
    assert [line.split()[1:3] for line in named[2:]] == [["lynx", "int8"], ["int8", "4/5"]]
    assert len({len(line) for line in named}) == 1  # the scheme column widened to the name
    ratios = ratio_table(summary)
    assert "0.80" in ratios and "-" in ratios  # no int4 in this run


def _timed(rid: str, sent: float, end: float, nbytes: int) -> RequestRow:
    """A completed INT8 request sent at ``sent`` whose stream landed at ``end``."""
    return request_row("int8", 0.5, 0, 0.0, _sink_result(rid, sent, end - sent, end - sent, nbytes=(nbytes, 0)))


def test_peak_egress_of_a_link_held_to_its_rate() -> None:
    # 1 Gbit/s, 100 MB requests: 0.8 s each; the second queues behind the first
    rows = [_timed("a", 0.0, 0.8, 100_000_000), _timed("b", 0.1, 1.6, 100_000_000)]
    assert peak_egress_gbps(rows) == pytest.approx(1.0)


def test_peak_egress_shows_peers_shaped_separately() -> None:
    # three overlapping 0.8 s transfers of 100 MB each: 3 Gbit/s at the link
    rows = [_timed(str(i), 0.01 * i, 0.01 * i + 0.8, 100_000_000) for i in range(3)]
    assert peak_egress_gbps(rows) == pytest.approx(300e6 * 8 / (0.82 * 1e9))
    failed = request_row("int8", 0.5, 0, 0.0, _sink_result("f", 0.0, None, None, Status.FAILED))
    assert peak_egress_gbps([failed]) is None
    # one small stream inside a shaper's burst says nothing about the rate
    assert peak_egress_gbps([_timed("s", 0.0, 0.001, 1_000_000)]) is None
    assert peak_egress_gbps([_timed("s", 0.0, 0.001, 1_000_000)], min_bytes=0) == pytest.approx(8.0)


# -- load.json -----------------------------------------------------------------------------------

def test_load_json_shape_round_trips(tmp_path: Path) -> None:
    rows = _rows()
    summary = summarize(rows, 1.0)
    config = {"command": "lynx load --requests 10", "seed": 0}
    path = write_load_json(tmp_path / "out" / "load.json", config, rows, summary, [{"phase": 0}])
    payload = json.loads(path.read_text())
    assert set(payload) == {"config", "requests", "summary", "phases"}
    assert payload["config"] == config
    assert all(tuple(r) == REQUEST_FIELDS for r in payload["requests"])
    assert all(tuple(s) == SUMMARY_FIELDS for s in payload["summary"])
    assert REQUEST_FIELDS == ("scheme", "load", "request_id", "decode_node", "arrival_s", "ttft_s", "ttfct_s",
                              "time_to_anchor_s", "time_to_full_s", "e2e_s", "bytes_anchor",
                              "bytes_residual", "status")
    assert SUMMARY_FIELDS == ("scheme", "load", "requests", "completed", "failed", "p50_ttft_s",
                              "p90_ttft_s", "p99_ttft_s", "p50_ttfct_s", "p99_ttfct_s", "p99_full_s",
                              "link_utilization")
    got_config, got_rows, got_summary = read_load_json(path)
    assert (got_config, got_rows, got_summary) == (config, rows, summary)
    assert not list(path.parent.glob("*.tmp"))


def test_read_load_json_rejects_other_columns(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"config": {}, "requests": [{"scheme": "x"}], "summary": []}))
    with pytest.raises(ValueError, match="request fields"):
        read_load_json(path)


# -- configuration -------------------------------------------------------------------------------

def test_default_config_is_valid(tmp_path: Path) -> None:
    cfg = LoadConfig(out=tmp_path).validate(max_context=8192)
    assert cfg.request_timeout_s == cfg.timeouts.stream_s
    d = cfg.to_json()
    assert d["link"] == "shaper" and d["decode"] == "sink" and d["out"] == str(tmp_path)
    json.dumps(d)


def test_the_default_split_is_auto(tmp_path: Path) -> None:
    cfg = LoadConfig(out=tmp_path)
    assert cfg.planes == cfg.split == "auto" and cfg.anchor_bits is None
    assert cfg.to_json()["planes"] == "auto"
    assert LoadConfig(out=tmp_path, anchor_bits=3).validate().split == (3, 5)
    assert LoadConfig(out=tmp_path, planes=(2, 2, 4)).validate().split == (2, 2, 4)
    assert json.loads(json.dumps(LoadConfig(planes=(3, 5)).to_json()))["planes"] == [3, 5]


def _int8_bytes(context: int) -> int:
    return sum(request_bytes(SMOLLM2, "int8", context))


def test_auto_at_a_small_context_on_a_fast_link_is_no_split() -> None:
    # 512 tokens, ~6 MB at INT8: 5 ms at 10 Gbit/s, under 3 steps of 100 ms
    choice = lynx_split(LoadConfig(context=512, bandwidth_gbps=10.0), _int8_bytes(512))
    assert choice.planes is None
    assert choice.reason.startswith("int8 (no split): ")
    assert split_label(choice.planes) == "int8"


@pytest.mark.parametrize(("context", "gbps", "planes"), [
    (4096, 1.0, (4, 4)),    # ~50 MB at INT8: 0.40 s on the link, 4 steps of 100 ms
    (8000, 1.0, (4, 4)),    # ~98 MB: 7.8 steps
    (4096, 0.25, (3, 5)),   # 16 steps
    (8000, 0.5, (3, 5)),    # 15.7 steps
])
def test_auto_on_a_big_cache_or_a_slow_link_splits(context: int, gbps: float, planes: tuple[int, ...]) -> None:
    choice = lynx_split(LoadConfig(context=context, bandwidth_gbps=gbps), _int8_bytes(context))
    assert choice.planes == planes
    assert choice.transfer_s == pytest.approx(_int8_bytes(context) * 8 / (gbps * 1e9))
    assert choice.reason.startswith(f"lynx {split_label(planes)}: ")


def test_a_fixed_split_is_not_chosen() -> None:
    cfg = LoadConfig(context=512, bandwidth_gbps=10.0, planes=(4, 4))
    assert lynx_split(cfg, _int8_bytes(512)).planes == (4, 4)  # auto would choose none here
    assert lynx_split(LoadConfig(anchor_bits=3), _int8_bytes(4096)).planes == (3, 5)


@pytest.mark.parametrize(("job", "want"), [
    ({"scheme": "lynx", "planes": [3, 5]}, (Scheme.LYNX, (3, 5))),
    ({"scheme": "lynx", "planes": None}, (Scheme.INT8, (4, 4))),  # auto chose no split
    ({"scheme": "lynx", "planes": "auto"}, (Scheme.LYNX, "auto")),  # the decode node chooses
    ({"scheme": "int4", "planes": None}, (Scheme.INT4, (4, 4))),
    ({"scheme": "int8", "planes": [2, 2, 4]}, (Scheme.INT8, (2, 2, 4))),
])
def test_the_split_a_job_asks_for(job: dict, want: tuple) -> None:
    assert job_split(job) == want


@pytest.mark.parametrize(("changes", "message"), [
    ({"schemes": ("lynx", "fp8")}, "unknown scheme 'fp8'"),
    ({"schemes": ("lynx", "lynx")}, "listed twice"),
    ({"schemes": ()}, "at least one scheme"),
    ({"loads": (0.5, 0.0)}, "--load: 0 is not a positive"),
    ({"loads": None, "rates_rps": (-1.0,)}, "--rate: -1 is not a positive"),
    ({"loads": (0.5,), "rates_rps": (1.0,)}, "either --load or --rate"),
    ({"loads": None}, "either --load or --rate"),
    ({"bandwidth_gbps": 0.0}, "--bandwidth"),
    ({"requests": 0}, "--requests"),
    ({"decode_nodes": 0}, "--decode-nodes"),
    ({"context": 10}, "too short"),
    ({"context": 8190}, "context window"),
    ({"anchor_bits": 8}, "--anchor-bits"),
    ({"max_pending": 0}, "--max-pending"),
    ({"planes": (3, 4)}, "--planes: planes 3,4 sum to 7 bits"),
    ({"planes": (7, 1)}, "--planes: planes 7,1: the anchor"),
    ({"planes": (8,)}, "--planes: planes 8: a split needs at least 2 planes"),
    ({"planes": "4,4"}, "--planes: expected plane widths"),
    ({"planes": (4, 4), "anchor_bits": 3}, "give --planes or --anchor-bits, not both"),
])
def test_bad_config_names_the_flag(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(LoadConfig(out=tmp_path), **changes).validate(max_context=8192)
