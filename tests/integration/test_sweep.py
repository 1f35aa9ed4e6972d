"""`lynx sweep` end to end: a tiny real sweep through two processes, one with two LYNX
splits side by side, and bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_bench.sweep.results import COLUMNS

LYNX = [sys.executable, "-m", "lynx_bench.cli"]


def _lynx(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LYNX, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.model
@pytest.mark.ucx
def test_tiny_sweep_writes_fixed_columns_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = _lynx("sweep", "--bandwidths", "1,10", "--contexts", "256", "--prompts", "1",
                 "--new-tokens", "4", "--repeats", "1", "--workload", "passkey", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((out / "results.json").read_text())
    assert payload["config"]["bandwidths_gbps"] == [1.0, 10.0]
    assert "lynx sweep" in payload["config"]["command"] or "sweep" in payload["config"]["command"]
    rows = payload["rows"]
    assert len(rows) == 2 * 4
    assert all(tuple(row) == COLUMNS for row in rows)
    assert {r["scheme"] for r in rows} == {"bf16", "int8", "int4", "lynx"}
    for row in rows:
        assert row["ttft_s"] > 0 and row["ttfct_s"] >= row["ttft_s"] and row["e2e_s"] >= row["ttfct_s"]
        assert row["bytes_total"] == row["bytes_anchor"] + row["bytes_residual"]
        assert row["accuracy"] in (0.0, 1.0)
        if row["scheme"] != "lynx":
            assert row["planes"] is None and row["first_token_correct"] is None
    lynx_rows = [r for r in rows if r["scheme"] == "lynx"]
    assert all(r["agreement_vs_int8"] == 1.0 for r in lynx_rows)
    assert all(r["planes"] == "4,4" and r["first_token_correct"] in (0.0, 1.0) for r in lynx_rows)
    assert all(r["bytes_residual"] > 0 for r in lynx_rows)
    size = {r["scheme"]: r["bytes_total"] for r in rows}
    assert size["int4"] < size["int8"] == size["lynx"] < size["bf16"]
    with (out / "results.csv").open() as fh:
        table = list(csv.reader(fh))
    assert tuple(table[0]) == COLUMNS and len(table) == 1 + len(rows)
    for png in ("ttft_vs_bandwidth.png", "accuracy.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
        assert str(out / png) in proc.stdout
    assert "ttft_s" in proc.stdout and "ttfct_s" in proc.stdout and "ttfct/int8.ttft" in proc.stdout
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    recorded = [r for r in runs if r["job"]["recorded"]]
    assert len(recorded) == len(rows)
    for run in recorded:
        assert run["ttft_s"] == next(r["ttft_s"] for r in rows if r["scheme"] == run["scheme"]
                                     and r["bandwidth_gbps"] == run["job"]["bandwidth_gbps"])
        # the first token needs every anchor region (by design; the lane's completion is stamped
        # by a callback after its last region's, so it can come a moment after the token)
        assert max(run["arrivals_s"][0]) <= run["ttft_s"]
        if run["scheme"] == "lynx":
            # the draft cache is ready once its last anchor region landed and was decoded (the
            # engine waits per layer, so its first token may come a moment before that stamp)
            assert max(run["arrivals_s"][0]) <= run["draft_ready_s"]
            assert max(run["arrivals_s"][0]) <= run["first_tentative_s"]
            assert run["planes"] == [4, 4]


@pytest.mark.model
@pytest.mark.ucx
def test_two_splits_run_side_by_side_as_named_schemes(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = _lynx("sweep", "--quick", "--bandwidths", "1", "--contexts", "256", "--new-tokens", "4",
                 "--planes", "4,4", "2,2,4", "--workload", "passkey", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((out / "results.json").read_text())
    assert payload["config"]["splits"] == [[4, 4], [2, 2, 4]]
    rows = payload["rows"]
    assert [r["scheme"] for r in rows] == ["bf16", "int8", "int4", "lynx-4", "lynx-2.2.4"]
    by = {r["scheme"]: r for r in rows}
    assert by["lynx-4"]["planes"] == "4,4" and by["lynx-2.2.4"]["planes"] == "2,2,4"
    for name in ("lynx-4", "lynx-2.2.4"):
        row = by[name]
        assert row["agreement_vs_int8"] == 1.0, name
        assert row["first_token_correct"] in (0.0, 1.0)
        assert 0 < row["ttft_s"] <= row["ttfct_s"] <= row["e2e_s"]
        assert row["bytes_total"] == by["int8"]["bytes_total"]
    # a 2-bit anchor is half the 4-bit one
    assert by["lynx-2.2.4"]["bytes_anchor"] < by["lynx-4"]["bytes_anchor"]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert {tuple(r["job"]["planes"] or ()) for r in runs if r["job"]["codec_scheme"] == "lynx"} == {
        (4, 4), (2, 2, 4)}
    for table_line in ("lynx-4", "lynx-2.2.4"):
        assert sum(table_line in line.split() for line in proc.stdout.splitlines()) == 2  # summary + ratios


@pytest.mark.parametrize(("args", "message"), [
    (["--bandwidths", "1,0"], "--bandwidths: 0 Gbit/s is not a positive"),
    (["--bandwidths", "-1"], "not a positive"),
    (["--schemes", "lynx,fp8"], "unknown scheme 'fp8'"),
    (["--contexts", "100000"], "context window"),
    (["--planes", "4,4", "3,4"], "--planes: planes 3,4 sum to 7 bits"),
    (["--anchor-bits", "4,7"], "--anchor-bits: anchor bits must be in 2..6, got 7"),
    (["--planes", "4,4", "--anchor-bits", "3"], "not allowed with argument"),
    (["--planes", "2,2,4", "--schemes", "int8"], "lynx is not among --schemes"),
])
def test_bad_arguments_fail_before_any_work(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _lynx("sweep", "--quick", "--out", str(tmp_path / "o"), *args, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "o" / "logs").exists()


def test_unwritable_out_fails_before_any_work(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = _lynx("sweep", "--quick", "--out", str(blocker / "sub"), timeout=120)
    assert proc.returncode == 2
    assert "--out: cannot write" in proc.stderr
