"""`lynx accuracy` end to end on the real model: a tiny report validated against its
fixed fields, and bad input refused before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_bench.accuracy.report import ROW_FIELDS, SUMMARY_FIELDS
from tests._lynx_cli import run_lynx

LYNX = [sys.executable, "-m", "lynx_bench.cli"]


def _lynx(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LYNX, *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.model
def test_tiny_accuracy_report(tmp_path: Path) -> None:
    out = tmp_path / "acc"
    proc = _lynx("accuracy", "--workloads", "fidelity", "--contexts", "192", "--cases", "2",
                 "--fidelity-tokens", "12", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((out / "accuracy.json").read_text())
    assert set(payload) == {"config", "rows", "summary"}
    config = payload["config"]
    assert config["workloads"] == ["fidelity"] and config["contexts"] == [192] and config["cases"] == 2
    assert config["corpus"] == "texts" and config["reference"] == "bf16"
    rows, summary = payload["rows"], payload["summary"]
    assert all(tuple(r) == ROW_FIELDS for r in rows) and all(tuple(s) == SUMMARY_FIELDS for s in summary)
    per_scheme = {"top1_agreement_vs_bf16", "kl_vs_bf16", "ppl"}
    expected = {(s, m, c) for s in ("bf16", "int8", "int4", "lynx") for m in per_scheme for c in (0, 1)}
    expected |= {("lynx", m, c) for m in ("draft_top1_agreement_vs_bf16", "equal_to_int8") for c in (0, 1)}
    assert {(r["scheme"], r["metric"], r["case"]) for r in rows} == expected
    assert all(r["workload"] == "fidelity" and r["context"] == 192 for r in rows)
    value = {(r["scheme"], r["metric"], r["case"]): r["value"] for r in rows}
    for case in (0, 1):
        assert value[("bf16", "top1_agreement_vs_bf16", case)] == 1.0
        assert value[("bf16", "kl_vs_bf16", case)] == 0.0
        assert value[("lynx", "equal_to_int8", case)] == 1.0
        for metric in per_scheme:  # LYNX's committed output is INT8's
            assert value[("lynx", metric, case)] == value[("int8", metric, case)]
        assert value[("int4", "kl_vs_bf16", case)] > value[("int8", "kl_vs_bf16", case)] >= 0.0
        assert 0.0 <= value[("lynx", "draft_top1_agreement_vs_bf16", case)] <= 1.0
        assert all(value[(s, "ppl", case)] > 1.0 for s in ("bf16", "int8", "int4"))
    for s in summary:
        assert s["cases"] == 2 and s["stderr"] is not None and s["stderr"] >= 0.0
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert "fidelity: top1_agreement_vs_bf16" in proc.stdout and str(out / "accuracy.json") in proc.stdout


@pytest.mark.model
@pytest.mark.slow
def test_generation_and_retrieval_check_lynx_against_int8(tmp_path: Path) -> None:
    out = tmp_path / "acc"
    proc = _lynx("accuracy", "--workloads", "generation,retrieval", "--contexts", "192", "--cases", "3",
                 "--generation-tokens", "6", "--answer-tokens", "12", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "accuracy.json").read_text())["rows"]
    value = {(r["workload"], r["scheme"], r["metric"], r["case"]): r["value"] for r in rows}
    assert {m for (w, _, m, _) in value if w == "generation"} == {
        "full_match_vs_bf16", "prefix_agreement_vs_bf16", "equal_to_int8"}
    assert {m for (w, _, m, _) in value if w == "retrieval"} == {"exact_match", "answer_nll", "equal_to_int8"}
    for case in range(3):
        assert value[("generation", "bf16", "full_match_vs_bf16", case)] == 1.0
        for workload, metrics in (("generation", ("full_match_vs_bf16", "prefix_agreement_vs_bf16")),
                                  ("retrieval", ("exact_match", "answer_nll"))):
            assert value[(workload, "lynx", "equal_to_int8", case)] == 1.0
            for metric in metrics:
                assert value[(workload, "lynx", metric, case)] == value[(workload, "int8", metric, case)]
        for scheme in ("bf16", "int8", "int4", "lynx"):
            assert value[("retrieval", scheme, "exact_match", case)] in (0.0, 1.0)
            assert value[("retrieval", scheme, "answer_nll", case)] > 0.0
            assert 0.0 <= value[("generation", scheme, "prefix_agreement_vs_bf16", case)] <= 1.0


@pytest.mark.parametrize(("args", "message"), [
    (("--workloads", "fidelity,speed"), "unknown workload 'speed'"),
    (("--cases", "0"), "--cases: must be a positive integer, got 0"),
    (("--contexts", "9000"), "exceeds the model's context window of 8192 tokens"),
    (("--ttft-from", "/nonexistent"), "--ttft-from: cannot read a sweep's results"),
    (("--texts", "GPL-3,NO-SUCH-LICENCE"), "--texts: no text 'NO-SUCH-LICENCE'"),
    (("--schemes", "int8,int4", "--anchor-bits", "3"), "lynx is not among --schemes"),
])
def test_bad_input_is_refused_before_the_model_loads(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    run = run_lynx("accuracy", *args, "--out", str(tmp_path / "acc"), timeout=120)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert run.imported == set(), f"imported {sorted(run.imported)}: it started loading the model"
    assert not (tmp_path / "acc" / "accuracy.json").exists()
    assert run.seconds < 60  # a generous bound: no model load, no prefill (about a second)


@pytest.mark.model
def test_a_context_longer_than_the_texts_is_refused_before_any_prefill(tmp_path: Path) -> None:
    proc = _lynx("accuracy", "--texts", "MPL-2.0", "--workloads", "generation", "--contexts", "7000",
                 "--cases", "1", "--out", str(tmp_path / "acc"), "--no-progress", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "longer than every text available" in proc.stderr
    assert not (tmp_path / "acc" / "accuracy.json").exists()
