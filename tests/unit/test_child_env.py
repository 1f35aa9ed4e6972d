"""The bench's child processes find the PyPI package ``kernels`` even when the driver was
started inside the checkout without ``PYTHONSAFEPATH`` (the ``lynx`` console script run
from the repository root): there ``python -m`` would put the checkout's ``kernels/``
first on ``sys.path``, and transformers' import of ``kernels`` then fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lynx_bench.common.processes import Child

ROOT = Path(__file__).resolve().parents[2]


def test_a_child_started_in_the_checkout_imports_the_pypi_kernels_not_the_checkouts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (ROOT / "kernels" / "__init__.py").exists()
    assert importlib.util.find_spec("kernels") is not None, "the PyPI package kernels is not installed"
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    # -c, like -m, puts the working directory first on sys.path unless safe-path is on
    code = "import kernels, os; print('AT', os.path.dirname(os.path.abspath(kernels.__file__)))"
    child = Child("probe", [sys.executable, "-c", code], tmp_path / "probe.log")
    try:
        where = Path(child.expect("AT ", 60.0))
    finally:
        child.stop()
    assert where != ROOT / "kernels"
    assert "site-packages" in where.parts
