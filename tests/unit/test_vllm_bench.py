"""``make vllm-bench``'s pure parts (:mod:`lynx_bench.vllm.bench_summary`): the flags, the rate rule
and ``summary.json``'s rows from a saved ``vllm bench serve`` result (a hand-written fixture in the
shape of a real run's ``--save-result --save-detailed`` JSON), the proxy's and the consumer's
records. No vLLM here: Lynx's main environment runs these."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from lynx_bench.vllm.bench_records import (
    consumer_ttfts,
    decode_overlaps,
    pulled,
    shaping_error,
    ttft_breakdown,
    wire_gbps,
)
from lynx_bench.vllm.bench_summary import (
    BenchConfig,
    Connector,
    auto_rate,
    failed_row,
    fill_equal_to_int8,
    link_shaping,
    parse_configs,
    parse_links,
    parse_rate,
    rate_rule,
    run_row,
    table,
)

FIXTURE = Path(__file__).parent / "data" / "vllm_bench_result.json"
ROW_KEYS = {"connector", "scheme", "load", "link_gbps", "link_shaping",
            "rate", "requests", "completed", "failed", "ttft_ms",
            "tpot_ms", "itl_ms", "e2el_ms", "consumer_ttft_ms", "equal_to_int8", "tpot_unloaded_ms",
            "pulled"}
INT8 = BenchConfig("lynx-int8", Connector.LYNX, "int8", "sync")
LYNX = BenchConfig("lynx-lynx", Connector.LYNX, "lynx", "sync")


def result() -> dict[str, Any]:
    return dict(json.loads(FIXTURE.read_text()))


def proxied(rid: str, sent: float, first: float, *, error: str | None = None) -> dict[str, Any]:
    return {"request_id": rid, "prefill_sent_at": sent - 1.2, "prefill_answered_at": sent, "decode_sent_at": sent,
            "decode_first_byte_at": first, "error": error}


# -- the flags --------------------------------------------------------------------------------
def test_configs_parse_in_order_into_connector_scheme_and_load() -> None:
    configs = parse_configs("none, lynx-int8,lynx-lynx-async,nixl")
    assert [c.name for c in configs] == ["none", "lynx-int8", "lynx-lynx-async", "nixl"]
    assert configs[0] == BenchConfig("none", Connector.NONE)
    assert configs[1] == INT8
    assert configs[2].load == "async" and configs[2].backend == (Connector.LYNX, "async")
    assert configs[3].connector is Connector.NIXL and configs[3].scheme is None


@pytest.mark.parametrize(("text", "says"), [
    ("none,lynx-fp4", "unknown configuration 'lynx-fp4'"),
    ("nixl-int8", "unknown configuration 'nixl-int8'"),
    ("lynx-int8-fast", "unknown configuration"),
    ("none,none", "names none more than once"),
    (" , ", "at least one configuration"),
])
def test_bad_configs_say_what_is_wrong_and_what_is_allowed(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says) as caught:
        parse_configs(text)
    if "unknown" in says:
        assert "none, nixl and lynx-<scheme>" in str(caught.value)


def test_links_are_unshaped_or_positive_gbit_rates_each_once() -> None:
    assert parse_links("unshaped") == (None,)
    assert parse_links("unshaped,0.5,1") == (None, 0.5, 1.0)
    for bad, says in [("0", "positive"), ("-1", "positive"), ("fast", "'unshaped' or a rate"),
                      ("nan", "positive"), ("0.5,0.5", "more than once"), ("", "at least one link")]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse_links(bad)


def test_rate_is_auto_or_a_positive_finite_number() -> None:
    assert parse_rate("auto") is None
    assert parse_rate("0.25") == 0.25
    for bad in ("0", "-2", "inf", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rate"):
            parse_rate(bad)


# -- the rate rule ----------------------------------------------------------------------------
def test_auto_rate_is_seven_tenths_of_one_prefill_per_measured_prefill_time() -> None:
    assert auto_rate(8.0) == pytest.approx(0.7 / 8.0)
    assert auto_rate(2.0, 0.5) == pytest.approx(0.25)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive time"):
            auto_rate(bad)
    with pytest.raises(ValueError, match="fraction"):
        auto_rate(1.0, 1.5)


def test_the_rate_rule_says_where_the_rate_came_from() -> None:
    auto = rate_rule(None, 8.0, 2048, "lynx-unshaped-producer")
    assert "0.7 x the producer's prefill throughput" in auto
    assert "2048-token" in auto and "lynx-unshaped-producer" in auto and "8.000 s" in auto and "0.0875" in auto
    assert rate_rule(0.2, None, 2048, None) == "fixed: --rate 0.2 requests/s"


# -- the rows ---------------------------------------------------------------------------------
def test_a_row_takes_vllms_metrics_and_the_proxys_decode_leg_ttft() -> None:
    records = [proxied("lynx-int8-unshaped-0", 10.0, 10.2), proxied("lynx-int8-unshaped-1", 20.0, 20.4),
               proxied("lynx-int8-unshaped-2", 30.0, 30.1, error="502 decode"),
               proxied("warmup.lynx-int8-unshaped.0", 5.0, 9.0)]  # another run's and the warm-up's: not counted
    row = run_row(INT8, None, 0.4, 3, result(), records, "lynx-int8-unshaped-")
    assert set(row) == ROW_KEYS
    assert (row["connector"], row["scheme"], row["load"], row["link_gbps"]) == ("lynx", "int8", "sync", None)
    assert row["link_shaping"] == "unshaped"
    assert (row["rate"], row["requests"], row["completed"], row["failed"]) == (0.4, 3, 2, 1)
    assert row["ttft_ms"] == {"mean": 1400.0, "median": 1400.0, "p99": 1596.0}
    assert row["tpot_ms"]["p99"] == 54.9 and row["itl_ms"]["median"] == 50.0 and row["e2el_ms"]["mean"] == 2250.0
    assert row["consumer_ttft_ms"]["median"] == pytest.approx(300.0)
    assert row["consumer_ttft_ms"]["p99"] == pytest.approx(398.0)
    assert row["equal_to_int8"] is None
    assert row["tpot_unloaded_ms"] is None  # measured for asynchronous configurations only
    json.dumps(row)  # JSON as it is


def test_an_asynchronous_row_carries_its_unloaded_tpot_and_the_table_shows_it() -> None:
    unloaded = {"idle": {"median": 41.0, "p99": 43.5}, "beside_prefills": {"median": 47.0, "p99": 62.4}}
    row = run_row(BenchConfig("lynx-int8-async", Connector.LYNX, "int8", "async"), 0.5, 0.4, 3, result(), [],
                  "x-", tpot_unloaded=unloaded)
    assert row["tpot_unloaded_ms"] == unloaded and row["load"] == "async"
    line = table([row]).splitlines()[2]
    # loaded p99 (54.9), unloaded p50 with nothing beside, unloaded p99 beside the producer's prefills
    assert "lynx-int8-async" in line and " 55    41     62 " in line


def test_a_row_without_a_proxy_has_no_consumer_ttft() -> None:
    row = run_row(BenchConfig("none", Connector.NONE), None, 0.4, 3, result(), None, "none-unshaped-")
    assert row["consumer_ttft_ms"] == {"median": None, "p99": None}
    assert (row["scheme"], row["load"]) == (None, None)


def test_a_configuration_that_did_not_run_has_a_row_of_nulls() -> None:
    row = failed_row(BenchConfig("nixl", Connector.NIXL), None, 0.4, 20)
    assert set(row) == ROW_KEYS
    assert (row["completed"], row["failed"]) == (0, 20)
    assert row["ttft_ms"] == {"mean": None, "median": None, "p99": None}
    assert "nixl" in table([row])
    assert failed_row(BenchConfig("nixl", Connector.NIXL), 0.5, 0.4, 20)["link_shaping"] == "netns-tc"


def test_a_rate_is_held_by_tc_on_the_namespace_link_and_no_rate_is_loopback() -> None:
    assert link_shaping(None) == "unshaped"
    assert link_shaping(0.5) == "netns-tc"
    assert run_row(INT8, 0.5, 0.4, 3, result(), [], "x-")["link_shaping"] == "netns-tc"


def test_nixl_servers_use_ucx_over_tcp_only_on_the_links_veth() -> None:
    from lynx_bench.vllm.bench_session import NIXL_EXTRA, nixl_env

    env = nixl_env("127.0.0.1", 5601, None)
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    veth = nixl_env("10.254.0.1", 5602, {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lynxvb-tx"})
    assert (veth["UCX_NET_DEVICES"], veth["VLLM_NIXL_SIDE_CHANNEL_HOST"]) == ("lynxvb-tx", "10.254.0.1")
    assert NIXL_EXTRA["num_threads"] >= 0 and NIXL_EXTRA["backends"] == ["UCX"]


def test_on_loopback_every_role_runs_here_at_127_0_0_1() -> None:
    from lynx_bench.vllm.bench_servers import Hosts

    hosts = Hosts(None)
    try:
        for role in Hosts.ROLES:
            assert hosts.argv(role, ["python", "-V"]) == ["python", "-V"]
            assert hosts.address(role) == "127.0.0.1"
            assert hosts.ucx_env(role) is None
        assert hosts.caller(lambda: 7) == 7
    finally:
        hosts.close()


def test_each_server_gets_cores_of_its_own_and_the_proxy_and_client_none() -> None:
    from lynx_bench.vllm.bench_servers import pinned, role_cpus

    assert role_cpus([1, 0]) == {"producer": (0,), "consumer": (1,)}
    assert role_cpus(range(8)) == {"producer": (0, 1, 2, 3), "consumer": (4, 5, 6, 7)}
    assert role_cpus([3]) == {}  # one core: nothing to give each server
    assert "client" not in role_cpus(range(4))
    assert pinned(["python", "-V"], (4, 5)) == ["taskset", "-c", "4,5", "python", "-V"]
    assert pinned(["python", "-V"], ()) == ["python", "-V"]


def test_pinning_without_taskset_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lynx_bench.common.errors import VllmNodeError
    from lynx_bench.vllm.bench_servers import pinned

    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no taskset on it
    with pytest.raises(VllmNodeError, match="taskset.*--no-pin"):
        pinned(["python", "-V"], (0,))
    assert pinned(["python", "-V"], ()) == ["python", "-V"]  # nothing asked: nothing needed


def test_pinning_is_the_default_and_no_pin_turns_it_off() -> None:
    from lynx_bench.vllm.bench import parse_args

    assert parse_args([]).pin is True
    assert parse_args(["--no-pin"]).pin is False


def test_servers_run_bfloat16_only_where_the_cpu_computes_in_it() -> None:
    import torch

    from lynx_bench.vllm.bench import parse_args
    from lynx_bench.vllm.bench_session import native_dtype

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native_dtype() == ("bfloat16" if native else "float32")
    assert parse_args([]).dtype == "auto"
    assert parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


def test_consumer_ttfts_keep_only_this_runs_successful_requests() -> None:
    records = [proxied("a-0", 1.0, 1.5), proxied("a-1", 2.0, 2.25), proxied("b-0", 1.0, 9.0),
               proxied("a-2", 3.0, 3.1, error="x"), {"request_id": "a-3", "decode_sent_at": 4.0, "error": None}]
    assert consumer_ttfts(records, "a-") == pytest.approx([500.0, 250.0])


def test_equal_to_int8_compares_lynx_texts_per_request_at_the_same_link_and_load() -> None:
    fixture = result()
    texts = [None if e else t for t, e in zip(fixture["generated_texts"], fixture["errors"])]
    rows = [run_row(c, link, 0.4, 3, fixture, [], "x-") for c, link in
            [(INT8, None), (LYNX, None), (LYNX, 0.5), (BenchConfig("none", Connector.NONE), None)]]
    # a failed request is not an equal one; the 0.5 Gbit/s lynx run has no int8 run to compare with
    fill_equal_to_int8(rows, [texts, texts, texts, texts])
    assert [r["equal_to_int8"] for r in rows] == [None, False, None, None]
    ok = ["a", "b", "c"]
    fill_equal_to_int8(rows, [ok, list(ok), ok, ok])
    assert rows[1]["equal_to_int8"] is True
    fill_equal_to_int8(rows, [ok, ["a", "b", "d"], ok, ok])
    assert rows[1]["equal_to_int8"] is False


def test_the_breakdown_finds_each_requests_own_load_among_ids_that_contain_it() -> None:
    records = [proxied("lynx-int8-unshaped-1", 10.0, 10.3)]
    loads = [  # vLLM's ids carry the client's inside their own; the warm-up's and request 10's contain it too
        {"request_id": "cmpl-warmup-lynx-int8-unshaped-1-0-aa", "requested_at": 2.0, "last_layer_landed_at": 2.1},
        {"request_id": "cmpl-lynx-int8-unshaped-10-0-bb", "requested_at": 10.01, "last_layer_landed_at": 10.02},
        {"request_id": "cmpl-lynx-int8-unshaped-1-0-cc", "requested_at": 10.02, "last_layer_landed_at": 10.22},
    ]
    parts = ttft_breakdown(records, loads, "lynx-int8-unshaped-")
    assert parts["prefill"]["median"] == pytest.approx(1200.0)
    assert parts["to_pull"]["median"] == pytest.approx(20.0)
    assert parts["transfer"]["median"] == pytest.approx(200.0)
    assert parts["first_step"]["median"] == pytest.approx(80.0)
    assert parts["consumer_ttft"]["median"] == pytest.approx(300.0)


def test_a_row_says_what_its_loads_pulled_each_form_once() -> None:
    """A ``lynx`` configuration under ``planes: auto`` pulls INT8 in vLLM: the row says so, from the
    consumer's own load records (failed loads and other runs' requests left out)."""
    records = [proxied("lynx-lynx-0.5G-1", 10.0, 10.3), proxied("lynx-lynx-0.5G-2", 20.0, 20.3),
               proxied("other-1", 10.0, 10.3)]
    loads = [{"request_id": "cmpl-lynx-lynx-0.5G-1-0-aa", "requested_at": 10.01, "scheme": "int8", "planes": None},
             {"request_id": "cmpl-lynx-lynx-0.5G-2-0-bb", "requested_at": 20.01, "scheme": "lynx",
              "planes": [4, 4]},
             {"request_id": "cmpl-other-1-0-cc", "requested_at": 10.01, "scheme": "bf16", "planes": None}]
    assert pulled(records, loads, "lynx-lynx-0.5G-") == ["int8", "lynx 4,4"]
    assert pulled(records, loads[:1], "lynx-lynx-0.5G-") == ["int8"]
    assert pulled(records, [], "lynx-lynx-0.5G-") is None
    row = run_row(LYNX, 0.5, 0.4, 3, result(), records, "lynx-lynx-0.5G-", pulled=["int8"])
    assert row["pulled"] == ["int8"] and table([row]).splitlines()[2].split()[-1] == "int8"


def test_each_decode_counts_what_ran_beside_it_another_requests_transfer_or_prefill() -> None:
    """Request 1 decodes over [10.3, 11.0]: request 2's transfer [10.5, 10.9] lands in it and
    request 3's prefill leg [10.8, 12.0] starts in it; request 2 decodes over [11.0, 11.2], beside
    request 3's prefill only; request 3 decodes alone. A request's own prefill and transfer, a
    failed load and another run's requests do not count."""
    records = [{**proxied("r-1", 10.0, 10.3), "done_at": 11.0},
               {**proxied("r-2", 10.4, 11.0), "done_at": 11.2},
               {**proxied("r-3", 12.0, 12.5), "done_at": 13.0},
               {**proxied("other-1", 10.0, 10.3), "done_at": 11.0}]
    loads = [{"request_id": "cmpl-r-1-0-aa", "requested_at": 10.0, "last_layer_landed_at": 10.29},
             {"request_id": "cmpl-r-2-0-bb", "requested_at": 10.5, "last_layer_landed_at": 10.9},
             {"request_id": "cmpl-r-3-0-cc", "requested_at": 12.1, "last_layer_landed_at": 12.4, "error": "x"}]
    assert decode_overlaps(records, loads, "r-") == {"decodes": 3, "beside_a_load": 1, "beside_a_prefill": 2}


def test_a_shaped_run_whose_loads_beat_the_link_is_named_not_shaped() -> None:
    """The loads' own rate (bytes over header to last layer) says whether they crossed the link:
    25 MB in 0.1 s is 2 Gbit/s, which no 0.5 Gbit/s link carries; 25 MB in 0.45 s is."""
    records = [proxied(f"lynx-int8-0.5G-{i}", 10.0 * i, 10.0 * i + 0.5) for i in range(1, 4)]

    def loads(seconds: float) -> list[dict[str, Any]]:
        return [{"request_id": f"cmpl-lynx-int8-0.5G-{i}-0-aa", "requested_at": 10.0 * i + 0.01,
                 "header_at": 10.0 * i + 0.02, "last_layer_landed_at": 10.0 * i + 0.02 + seconds,
                 "bytes_on_wire": 25_000_000, "error": None} for i in range(1, 4)]

    fast = wire_gbps(records, loads(0.1), "lynx-int8-0.5G-")
    assert fast == pytest.approx([2.0] * 3)
    why = shaping_error(0.5, fast) or ""
    assert "2.00 Gbit/s" in why and "did not go through it" in why
    held = wire_gbps(records, loads(0.45), "lynx-int8-0.5G-")
    assert shaping_error(0.5, held) is None
    assert shaping_error(None, fast) is None  # loopback: nothing to hold
    assert shaping_error(0.5, []) is None     # no loads (NIXL, none): nothing to judge by


def test_lynx_servers_on_a_link_pin_their_own_ucx_to_its_veth() -> None:
    """Lynx's transport gives UCX's context its own transports, which win over UCX_TLS: the
    connector must be told, or two servers on one host move the cache by cma past tc."""
    from lynx_bench.vllm.bench_session import lynx_ucx

    assert lynx_ucx(None) == {}
    assert lynx_ucx({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lynxvb-tx0"}) == {"ucx_tls": "tcp",
                                                                             "ucx_net_devices": "lynxvb-tx0"}


def test_the_table_has_one_fixed_width_line_per_row() -> None:
    rows = [run_row(INT8, None, 0.4, 3, result(), [], "x-"), failed_row(LYNX, 0.5, None, 3)]
    lines = table(rows).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines[:3]}) == 1
    assert lines[2].split()[:4] == ["lynx-int8", "unshaped", "0.400", "2/1"]
    assert lines[3].split()[1] == "0.5G"
