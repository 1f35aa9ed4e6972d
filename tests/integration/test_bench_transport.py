"""``lynx bench-transport --quick`` end to end, with every peer engine that is installed.

Runs the CLI as a user does and validates the JSON: Lynx's fields, each peer
engine's (numbers when it is installed; null, and a skip reason carrying the
install hint, when it is not), the ratios, the latency table and the shaping
errors on both transports. No throughput threshold: on this shared 2-core box the
numbers follow the load (``--check`` holds a run to the targets).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lynx_bench.transport_bench.cli import TARGETS
from lynx_bench.transport_bench.peers.engines import Engine, missing

pytestmark = pytest.mark.ucx

LYNX = [sys.executable, "-m", "lynx_bench.cli"]
INSTALLED = [e for e in Engine if missing(e) is None]
FIELDS = {
    Engine.NIXL: ["nixl_gbps", "nixl_progress_thread_gbps", "nixl_polling_gbps", "nixl_written_gbps",
                  "nixl_progress_thread_written_gbps", "nixl_polling_written_gbps", "nixl_tcp_gbps",
                  "nixl_tcp_progress_thread_gbps", "nixl_tcp_polling_gbps", "lynx_vs_nixl",
                  "lynx_written_vs_nixl_written", "lynx_tcp_vs_nixl_tcp", "lynx_p99_64k_vs_best_peer",
                  "lynx_oneway_1m_vs_nixl_polling"],
    Engine.MOONCAKE: ["mooncake_tcp_gbps", "lynx_tcp_vs_mooncake_tcp", "lynx_tcp_oneway_64k_vs_mooncake_tcp"],
}
LATENCY = {Engine.NIXL: ["nixl_progress_thread", "nixl_polling", "nixl_tcp_progress_thread",
                         "nixl_tcp_polling", "nixl_notified"],
           Engine.MOONCAKE: ["mooncake_tcp"]}
SIZES = ["65536", "1048576"]


def _positive(value: object) -> bool:
    return isinstance(value, float | int) and value > 0


def test_quick_mode_with_each_installed_peer(tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [*LYNX, "bench-transport", "--quick", "--size-mib", "4", "--shaping-gbps", "1",
         "--latency-messages", "10", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())

    for key in ["lynx_gbps", "lynx_written_gbps", "lynx_tcp_gbps", "ucxx_gbps", "asyncio_tcp_gbps",
                "ucx_perftest_gbps", "ucx_perftest_tcp_gbps", "lynx_tcp_vs_ucx_perftest_tcp",
                "anchor_under_load_ratio"]:
        assert _positive(result[key]), key
    for key in ["shaping_error", "shaping_error_tcp"]:
        assert isinstance(result[key], float) and result[key] >= 0, key
    assert set(result["details"]["shaping"]) == set(result["details"]["shaping_tcp"]) == {"1.0"}
    for name in ["lynx", "lynx_tcp"]:
        assert set(result["latency"][name]) == set(SIZES)
        for size in SIZES:
            whole, data = result["latency"][name][size], result["details"]["lynx_data_path_latency"][name][size]
            assert 0 < data["median_us"] <= whole["median_us"], (name, size)
            oneway = result["latency"][f"{name}_oneway"][size]
            assert oneway["messages"] == 10 and 0 < oneway["median_us"] <= oneway["p99_us"], (name, size)
    for size in SIZES:  # the physical limit, measured in the same run (it reports no tail)
        perftest = result["latency"]["ucx_perftest"][size]
        assert _positive(perftest["median_us"]) and perftest["p99_us"] is None, perftest
    for key in ["lynx_oneway_64k_median_us", "lynx_oneway_64k_p99_us", "lynx_oneway_64k_vs_ucx_perftest"]:
        assert _positive(result[key]), key
    assert set(result["targets_met"]) == set(TARGETS)

    for engine in Engine:
        if engine in INSTALLED:
            assert engine.value not in result["skipped"]
            for key in FIELDS[engine]:
                assert _positive(result[key]), key
                assert result["targets_met"].get(key, True) is not None, key
            for name in LATENCY[engine]:
                for size in SIZES:
                    lat = result["latency"][name][size]
                    assert lat["messages"] == 10
                    assert 0 < lat["median_us"] <= lat["p99_us"], (name, size, lat)
        else:  # never dropped silently: null fields and the reason with the install hint
            assert "--install-peers" in result["skipped"][engine.value]
            assert all(result[key] is None for key in FIELDS[engine] if not key.startswith("lynx_p99")), engine
            assert not any(name in result["latency"] for name in LATENCY[engine])
    if Engine.NIXL in INSTALLED:
        assert result["nixl_config"] in ("progress_thread", "polling")
        assert result["nixl_gbps"] == max(result["nixl_progress_thread_gbps"], result["nixl_polling_gbps"])
        assert result["lynx_vs_nixl"] == pytest.approx(result["lynx_gbps"] / result["nixl_gbps"], abs=2e-3)
    if Engine.MOONCAKE in INSTALLED:
        assert result["lynx_tcp_vs_mooncake_tcp"] == pytest.approx(
            result["lynx_tcp_gbps"] / result["mooncake_tcp_gbps"], abs=2e-3)
    for engine in Engine:  # the table names what was skipped, too
        if engine not in INSTALLED:
            assert f"skipped {engine.value}:" in proc.stdout


def test_an_engine_that_fails_to_import_is_skipped_with_the_hint(tmp_path, monkeypatch) -> None:
    """A broken install (the module is there, its import fails in the engine's child)."""
    from lynx_bench.transport_bench.peer_runs import PeerBackends

    fake = tmp_path / "nixl_cu12"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned children get this sys.path too
    peers = PeerBackends([Engine.NIXL], 1 << 20, "tcp", {})
    assert peers.skipped == {}
    assert peers.run(peers.names()[0], [(1 << 20, 1, False, False)], 0.0) is None
    reason = peers.skipped["nixl"]
    assert "libfoo.so" in reason and "--install-peers" in reason
    assert peers.names() == []
