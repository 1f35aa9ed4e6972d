"""`lynx sweep` on the text workloads: fidelity (the default) and generation, tiny and real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LYNX = [sys.executable, "-m", "lynx_bench.cli"]


def _sweep(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run([*LYNX, "sweep", "--quick", "--bandwidths", "1", "--contexts", "256", "--new-tokens", "8",
                           *args, "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "results.json").read_text())


@pytest.mark.model
@pytest.mark.ucx
@pytest.mark.slow
def test_generation_scores_equality_with_bf16(tmp_path: Path) -> None:
    proc, payload = _sweep(tmp_path / "gen", "--workload", "generation")
    assert payload["config"]["workload"] == "generation"
    by = {r["scheme"]: r for r in payload["rows"]}
    assert set(by) == {"bf16", "int8", "int4", "lynx-auto", "lynx-4"}  # the --quick schemes
    for row in by.values():
        assert row["accuracy"] == row["agreement_vs_bf16"] and row["accuracy"] in (0.0, 1.0)
    assert by["bf16"]["accuracy"] == 1.0
    for lynx in ("lynx-auto", "lynx-4"):
        assert by[lynx]["agreement_vs_int8"] == 1.0 and by[lynx]["accuracy"] == by["int8"]["accuracy"]
    # a 256-token text prompt caches 255 positions: each LYNX plane region is padded to 64 bytes on its own
    size = {s: r["bytes_total"] for s, r in by.items()}
    assert size["int4"] < size["int8"] <= size["lynx-4"] < size["int8"] + 4 * 64 * 30 < size["bf16"]
    assert "acc (generation)" in proc.stdout


@pytest.mark.model
@pytest.mark.ucx
def test_fidelity_is_the_default_and_scores_teacher_forced_agreement_after_the_runs(tmp_path: Path) -> None:
    proc, payload = _sweep(tmp_path / "fid")
    assert payload["config"]["workload"] == "fidelity"
    by = {r["scheme"]: r for r in payload["rows"]}
    assert by["bf16"]["accuracy"] == 1.0
    for lynx in ("lynx-auto", "lynx-4"):  # the committed cache is INT8's, whatever the split
        assert by[lynx]["accuracy"] == by["int8"]["accuracy"]
    assert 0.0 < by["int4"]["accuracy"] <= by["int8"]["accuracy"] <= 1.0
    assert "acc (fidelity)" in proc.stdout
