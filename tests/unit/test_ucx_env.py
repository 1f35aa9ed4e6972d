"""UCX starts without warnings: a loopback transfer in a fresh process prints no
``UCX  WARN`` line (ucxx's late ``UCX_MEMTYPE_CACHE`` write used to print one in
every command, see ``lynx_transport.ucx.adapter._import_ucxx``), and UCX's own check for
mistyped ``UCX_*`` variables still reports them (nothing was silenced)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx

#: One small stream over real UCX on loopback, both ends in the child process.
LOOPBACK = """
import numpy as np
from lynx_transport import Lane, ReceivePool, Receiver, connect

data = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
with Receiver(ReceivePool(1 << 22)) as rx, connect(rx.address, timeout=10.0) as conn:
    sent = conn.send_stream([("r", data, Lane.ANCHOR)], metadata=b"m")
    got = rx.next_stream(timeout=10.0)
    got.wait(timeout=10.0)
    assert bytes(got.view("r")) == data.tobytes()
    got.release()
    sent.wait(timeout=10.0)
print("transferred")
"""


def _run(extra_env: dict[str, str]) -> str:
    """The loopback script in a fresh interpreter whose environment is a clean shell's:
    no ``UCX_*`` variable (this test process may hold ucxx's) but ``extra_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(extra_env)
    done = subprocess.run([sys.executable, "-c", LOOPBACK], env=env, capture_output=True,
                          text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "transferred" in done.stdout, output
    return output


def test_a_loopback_transfer_prints_no_ucx_warning() -> None:
    output = _run({})
    assert [line for line in output.splitlines() if "UCX  WARN" in line] == []


def test_a_mistyped_ucx_variable_is_still_reported() -> None:
    output = _run({"UCX_LYNX_NO_SUCH_OPTION": "1"})
    warnings = [line for line in output.splitlines() if "UCX  WARN" in line]
    assert any("UCX_LYNX_NO_SUCH_OPTION" in line for line in warnings), output
    assert not any("MEMTYPE_CACHE" in line for line in warnings), output


def test_a_users_own_memtype_cache_setting_is_kept() -> None:
    script = ("import os\nfrom lynx_transport.ucx.adapter import UcxWorker\n"
              "UcxWorker('^posix,sysv').close()\nprint(os.environ['UCX_MEMTYPE_CACHE'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_MEMTYPE_CACHE"] = "y"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["y"]
    assert "UCX  WARN" not in done.stderr
