"""`lynx load` end to end: a short real load run (a `lynx serve` prefill node, two
sink decode nodes, UCX), and bad input."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_bench.load.results import REQUEST_FIELDS, SUMMARY_FIELDS

LYNX = [sys.executable, "-m", "lynx_bench.cli"]


def _lynx(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LYNX, *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module", params=["shaper", pytest.param("netns", marks=pytest.mark.netns)])
def load_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[str, Path, subprocess.CompletedProcess[str]]:
    """One short real load run per link (shared by the checks of what happened and the
    timing check, so a run that selects both does the load once)."""
    link = request.param
    out = tmp_path_factory.mktemp(f"load-{link}") / "load"
    # --planes 4,4: at 512 tokens on 1 Gbit/s the default, auto, would choose no split (INT8)
    proc = _lynx("load", "--decode", "sink", "--schemes", "int8,lynx", "--bandwidth", "1",
                 "--context", "512", "--decode-nodes", "2", "--load", "0.5", "--requests", "8",
                 "--planes", "4,4", "--link", link, "--out", str(out), "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return link, out, proc


@pytest.mark.model
@pytest.mark.ucx
def test_short_load_run_completes_every_request_and_lynx_anchors_come_first(
        load_run: tuple[str, Path, subprocess.CompletedProcess[str]]) -> None:
    link, out, proc = load_run
    payload = json.loads((out / "load.json").read_text())
    assert set(payload) == {"config", "requests", "summary", "phases"}
    config = payload["config"]
    assert "load" in config["command"] and config["seed"] == 0
    assert config["decode_nodes"] == 2 and config["context"] == 512 and config["loads"] == [0.5]
    assert "prefill" in config and "cached" in config["prefill"]
    assert config["planes"] == config["lynx_planes"] == [4, 4]
    rows = payload["requests"]
    assert len(rows) == 2 * 8
    assert all(tuple(r) == REQUEST_FIELDS for r in rows)
    assert all(r["status"] == "completed" for r in rows), [r for r in rows if r["status"] != "completed"]
    assert {r["decode_node"] for r in rows} == {0, 1}
    assert len({r["request_id"] for r in rows}) == len(rows)
    for r in rows:
        assert 0 < r["time_to_anchor_s"] <= r["time_to_full_s"]
        assert r["ttfct_s"] == r["time_to_full_s"] and r["e2e_s"] is None and r["arrival_s"] >= 0
    int8 = [r for r in rows if r["scheme"] == "int8"]
    lynx = [r for r in rows if r["scheme"] == "lynx"]
    # the same seeded schedule for both schemes
    assert [r["decode_node"] for r in int8] == [r["decode_node"] for r in lynx]
    assert [r["arrival_s"] for r in lynx] == pytest.approx([r["arrival_s"] for r in int8], abs=0.05)
    assert all(r["ttft_s"] == r["time_to_full_s"] for r in int8)
    # the link is held to 1 Gbit/s (a shaper's burst aside): no stream beats it
    assert config["link"] == link
    assert min(r["time_to_full_s"] for r in int8) > 0.7 * int8[0]["bytes_anchor"] * 8 / 1e9
    assert all(r["ttft_s"] == r["time_to_anchor_s"] < r["time_to_full_s"] for r in lynx)
    assert all(r["bytes_residual"] == 0 for r in int8) and all(r["bytes_residual"] > 0 for r in lynx)
    assert sum(lynx[0][k] for k in ("bytes_anchor", "bytes_residual")) >= int8[0]["bytes_anchor"]
    summary = payload["summary"]
    assert [(s["scheme"], s["load"]) for s in summary] == [("int8", 0.5), ("lynx", 0.5)]
    for s in summary:
        assert tuple(s) == SUMMARY_FIELDS
        assert (s["requests"], s["completed"], s["failed"]) == (8, 8, 0)
        assert 0 < s["p50_ttft_s"] <= s["p90_ttft_s"] <= s["p99_ttft_s"]
        assert 0 < s["link_utilization"] < 1.5
    assert len(payload["phases"]) == 2
    assert [p["planes"] for p in payload["phases"]] == [None, {"4,4": 8}]
    # one rate for the prefill node's egress, all decode nodes together
    assert all(p["peak_egress_gbps"] is None or p["peak_egress_gbps"] < 1.25 for p in payload["phases"])
    assert "more than --bandwidth" not in proc.stderr
    for png in ("ttft_cdf.png", "p99_vs_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
        assert str(out / png) in proc.stdout
    assert "p99_ttft" in proc.stdout


@pytest.mark.model
@pytest.mark.ucx
@pytest.mark.timing
def test_lynxs_median_ttft_beats_int8s_under_load(load_run: tuple[str, Path, subprocess.CompletedProcess[str]],
                                                 timing) -> None:
    """A performance claim: the anchors (half INT8's bytes) come first, so LYNX's first token
    comes sooner than INT8's, at the median of the run's requests."""
    link, out, _ = load_run
    rows = json.loads((out / "load.json").read_text())["requests"]
    median = {scheme: statistics.median(r["ttft_s"] for r in rows if r["scheme"] == scheme)
              for scheme in ("int8", "lynx")}
    timing.less_than(f"LYNX's median TTFT over the {link} link, against INT8's", median["lynx"], median["int8"])


@pytest.mark.parametrize(("args", "message"), [
    (["--schemes", "lynx,fp8"], "unknown scheme 'fp8'"),
    (["--load", "0.5,-1"], "--load: -1 is not a positive"),
    (["--context", "100000"], "context window"),
    (["--requests", "0"], "--requests"),
    (["--planes", "3,4"], "--planes: planes 3,4 sum to 7 bits"),
])
def test_bad_arguments_fail_before_any_work(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _lynx("load", "--out", str(tmp_path / "o"), *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "o" / "logs").exists()


def test_load_and_rate_are_exclusive(tmp_path: Path) -> None:
    proc = _lynx("load", "--load", "0.5", "--rate", "2", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 2
    assert "not allowed with argument" in proc.stderr


def test_planes_and_anchor_bits_are_exclusive(tmp_path: Path) -> None:
    proc = _lynx("load", "--planes", "4,4", "--anchor-bits", "3", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 2
    assert "not allowed with argument" in proc.stderr
