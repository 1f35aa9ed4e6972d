"""examples/embed_loopback.py, the README's "Embedding Lynx" example, runs as a user runs it.

The script is the receiver and starts the sender as a second process; both use
real UCX on loopback. Run in a subprocess of the current interpreter, it must
print one ``embed_loopback: ok ...`` line and exit 0: every plane on its own lane,
a draft from the anchor alone, and the exact layer bitwise equal to INT8. With
the default backend (Numba) on a cold kernel cache both processes compile the
codec first (about a minute and a half on two cores, measured), hence the long
timeout; `.ci/run` runs the same script from a fresh install of the wheel.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lynx_decode.codec import CodecConfig, LayerLayout

pytestmark = pytest.mark.ucx

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "embed_loopback.py"


def run_example(*args: str, timeout: float = 120) -> dict[str, str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("embed_loopback:")]
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("embed_loopback: ok "), lines[0]
    return dict(re.findall(r"(\w+)=(\S+)", lines[0]))


def test_default_split_two_lanes_equal_to_int8() -> None:
    out = run_example("--tokens", "1024", timeout=600)
    assert out["planes"] == "4,4"
    assert out["backend"] == "auto"
    assert out["shape"] == "3x1024x64"
    assert out["equal_to_int8"] == "True"
    assert out["sender_rc"] == "0"
    lanes = dict(item.split(":") for item in out["lanes"].split(","))
    assert sorted(lanes) == ["0", "1"]  # Lane.ANCHOR and Lane.RESIDUAL
    assert sorted(out["landed"].split(",")) == ["0", "1"]  # each lane landed once (order: the link's business)
    assert 0 < float(out["anchor_ms"]) <= float(out["full_ms"])
    # a 4-bit anchor drafts within ~10 % relative error on Gaussian K/V (8.6 % measured)
    assert 0.0 < float(out["draft_err_k"]) < 0.12
    assert 0.0 < float(out["draft_err_v"]) < 0.12


def test_three_planes_unshaped_numpy_reference() -> None:
    out = run_example("--planes", "2,2,4", "--tokens", "256", "--gbps", "0", "--backend", "numpy")
    assert out["planes"] == "2,2,4"
    assert out["equal_to_int8"] == "True"
    layout = LayerLayout.build(CodecConfig(planes=(2, 2, 4)), 3, 256, 64)
    assert out["lanes"] == ",".join(f"{p}:{layout.plane_size(p)}B" for p in range(3))
