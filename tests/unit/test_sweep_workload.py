"""The sweep's workloads: the config's field and checks, and the accuracy column per workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lynx_bench.sweep.cli import _Job, _rows
from lynx_bench.sweep.config import DEFAULT_WORKLOAD, TEXT_CONTINUATION, SweepConfig, SweepWorkload
from lynx_transport.errors import ConfigError


def test_the_default_workload_is_fidelity_and_recorded(tmp_path: Path) -> None:
    config = SweepConfig(out=tmp_path).validate(max_context=8192)
    assert DEFAULT_WORKLOAD is SweepWorkload.FIDELITY and config.workload is DEFAULT_WORKLOAD
    assert config.to_json()["workload"] == "fidelity"
    assert SweepConfig(out=tmp_path, workload=SweepWorkload.PASSKEY).to_json()["workload"] == "passkey"


def test_fidelity_needs_room_for_the_teacher_forced_tokens(tmp_path: Path) -> None:
    ctx = 8192 - TEXT_CONTINUATION
    SweepConfig(out=tmp_path, contexts=(ctx,), workload=SweepWorkload.FIDELITY).validate(max_context=8192)
    SweepConfig(out=tmp_path, contexts=(ctx + 1,), workload=SweepWorkload.GENERATION).validate(max_context=8192)
    with pytest.raises(ConfigError, match="teacher-forced tokens .--workload fidelity. exceeds"):
        SweepConfig(out=tmp_path, contexts=(ctx + 1,), workload=SweepWorkload.FIDELITY).validate(max_context=8192)


def _result(tokens: list[int], accuracy: float | None) -> dict[str, Any]:
    return {"ttft_s": 0.2, "ttfct_s": 0.3, "e2e_s": 1.0, "acceptance_rate": None, "bytes_anchor": 1,
            "bytes_residual": 0, "bytes_total": 1, "accuracy": accuracy, "tokens": tokens, "text": "",
            "first_tentative_token": None}


def _results(accuracy: float | None) -> list[tuple[_Job, dict[str, Any]]]:
    return [(_Job(1.0, 256, 0, 0, "bf16", "bf16"), _result([1, 2, 3], accuracy)),
            (_Job(1.0, 256, 0, 0, "int8", "int8"), _result([1, 2, 3], accuracy)),
            (_Job(1.0, 256, 0, 0, "int4", "int4"), _result([1, 2, 4], accuracy)),
            (_Job(1.0, 256, 0, 0, "lynx", "lynx", (4, 4)), _result([1, 2, 3], accuracy))]


def test_generation_accuracy_is_equality_with_the_bf16_run() -> None:
    rows = {r.scheme: r for r in _rows(_results(None), SweepWorkload.GENERATION)}
    assert {s: r.accuracy for s, r in rows.items()} == {"bf16": 1.0, "int8": 1.0, "int4": 0.0, "lynx": 1.0}
    assert all(r.accuracy == r.agreement_vs_bf16 for r in rows.values())


def test_passkey_accuracy_is_the_workers_score() -> None:
    rows = _rows(_results(1.0), SweepWorkload.PASSKEY)
    assert [r.accuracy for r in rows] == [1.0] * 4
    assert [r.accuracy for r in _rows(_results(None), SweepWorkload.FIDELITY)] == [None] * 4  # filled in later
