"""The research scripts under ``experiments/`` (outside the wheel) still start: ``--help`` runs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"


@pytest.mark.parametrize("script", sorted(p.name for p in EXPERIMENTS.glob("*.py")))
def test_help(script: str) -> None:
    run = subprocess.run([sys.executable, str(EXPERIMENTS / script), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout
