"""A peer paused in the middle of a shaped stream: a real ``lynx serve`` process and
a real ``lynx generate --check`` process (a tiny random model, UCX, the link held
to a few Mbit/s so the stream lasts seconds); one of the two is stopped with
SIGSTOP for 4 s while the residual is on the wire, then continued with SIGCONT.

The run completes, its committed tokens equal INT8's, and the arrival timeline
shows the pause: regions landed before it, the rest after it, none for seconds
in between. Both nodes run with the default timeouts (no ``--peer-timeout``): a
stopped process is silent, and a node must not take a pause of a few seconds
for a lost peer (with ``--peer-timeout 1.5``, the old default, both runs fail:
``peer ... silent for 1.50 s``, the decode node for a stopped prefill node, the
prefill node for a stopped receiver).

"The residual is on the wire" is probed, not slept for: ``lynx generate
--stream`` runs on a pseudo-terminal, where tentative tokens are drawn as they
are drafted, and the first one is drafted only once the anchors have landed;
the residual lane is then still in flight.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from lynx_bench.accuracy.workload import filler_prose
from lynx_bench.common.processes import Child
from tests._tiny_models import build

pytestmark = [pytest.mark.model, pytest.mark.ucx]

#: How long the node is stopped (well past the transport's old 1.5 s silence limit).
PAUSE_S = 4.0
#: The tiny model made wide enough that a stream is a few MB: 8 layers x 4 KV heads x 64,
#: 512 bytes of INT8 KV per token and layer.
MODEL: dict[str, Any] = dict(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, head_dim=64)
PROMPT_TOKENS = 600
#: 2-bit anchors: 8 anchor regions of ~97 kB (the quantization parameters with them) and
#: 8 residual regions of 230 kB. The shaper's 1 MiB burst lets the anchors and the first two
#: residual regions go at once; at 0.23 MB/s the other six take ~6 s, the pause among them.
ANCHOR_BITS = 2
GBPS = 0.0018
NEW_TOKENS = 16
#: Bounds on every wait (never reached by a passing run): a node's start, the probe, the run.
START_S = 300.0
RUN_S = 300.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("tiny-model") / "llama", seed=3, **MODEL)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Both nodes' environment: a cache folder of their own."""
    return {**os.environ, "LYNX_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def server(model_dir: Path, env: dict[str, str]) -> Iterator[tuple[Child, str]]:
    """A ``lynx serve`` child prefilling every request, and its ``HOST:PORT``."""
    log = Path(tempfile.mkstemp(prefix="lynx-serve-", suffix=".log")[1])
    child = Child("lynx serve", [sys.executable, "-m", "lynx_bench.cli", "serve", "--listen", "127.0.0.1:0",
                                 "--model", str(model_dir), "--no-prefill-cache", "--threads", "1"],
                  log, env=env)
    try:
        yield child, child.expect("listening on", START_S)
    finally:
        _resume(child.proc.pid)  # a stopped child would not act on stop()'s SIGTERM
        child.stop()
        log.unlink(missing_ok=True)


class TerminalRun:
    """A ``lynx generate`` child whose stdout is a pseudo-terminal, read on a thread
    (so the child never blocks on a full terminal); ``shown`` is set once it drew
    anything: with ``--stream`` on a terminal, the first tentative token."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        master, slave = os.openpty()
        self._master = master
        self._log = log.open("wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=self._log,
                                         env={**env, "TERM": "xterm", "COLUMNS": "200"}, close_fds=True)
        finally:
            os.close(slave)
        self.log_path = log
        self.output = bytearray()
        self.shown = threading.Event()
        self._reader = threading.Thread(target=self._read, name="lynx-generate-pty", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 4096)
            except OSError:  # EIO: the child closed the terminal (it exited)
                break
            if not data:
                break
            self.output += data
            self.shown.set()

    def wait_shown(self, timeout: float) -> None:
        """Until the child drew something; fails with its stderr if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while not self.shown.wait(0.05):
            if self.proc.poll() is not None:
                pytest.fail(f"lynx generate exited with {self.proc.returncode} before drawing a token"
                            f"{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"lynx generate drew no token within {timeout:.0f} s{self.tail()}")

    def tail(self) -> str:
        self._log.flush()
        return _tail("lynx generate", self.log_path)

    def close(self) -> None:
        _resume(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._reader.join(10)
        os.close(self._master)
        self._log.close()


def _tail(name: str, log: Path, n: int = 30) -> str:
    """The end of a child's stderr, for a failure message (the child's traceback)."""
    lines = log.read_text(errors="replace").splitlines()[-n:]
    return f"; {name}'s stderr ends:\n  " + "\n  ".join(lines) if lines else f"; {name}'s stderr is empty"


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (ids of processes that still exist)."""
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)  # SIGSTOP and SIGCONT cannot be caught: no handler in the child
        except ProcessLookupError:
            pass


def _resume(pid: int) -> None:
    _signal(_family(pid), signal.SIGCONT)


def _pause(pid: int, seconds: float) -> tuple[float, float]:
    """Stop ``pid`` and its children for ``seconds``; the (unix) times of the stop and the continue."""
    family = _family(pid)
    assert family, f"process {pid} is gone"
    stopped = time.time()
    try:
        _signal(family, signal.SIGSTOP)
        time.sleep(seconds)  # the pause itself, not a wait for readiness
    finally:
        resumed = time.time()
        _signal(family, signal.SIGCONT)
    return stopped, resumed


@pytest.mark.parametrize("paused", ["prefill", "decode"])
def test_a_node_paused_mid_stream_for_seconds_resumes_and_the_run_equals_int8(
        paused: str, model_dir: Path, server: tuple[Child, str], env: dict[str, str], tmp_path: Path) -> None:
    serve, address = server
    prompt, out_json = tmp_path / "prompt.txt", tmp_path / "run.json"
    prompt.write_text(filler_prose(lambda text: list(text.encode()), PROMPT_TOKENS, 25))  # byte tokens
    argv = [sys.executable, "-m", "lynx_bench.cli", "generate", "--connect", address,
            "--prompt-file", str(prompt), "--model", str(model_dir), "--threads", "1",
            "--scheme", "lynx", "--anchor-bits", str(ANCHOR_BITS), "--bandwidth", str(GBPS),
            "--max-new-tokens", str(NEW_TOKENS),
            "--check", "--stream", "--json", str(out_json)]
    run = TerminalRun(argv, env, tmp_path / "generate.log")
    try:
        run.wait_shown(START_S)  # the anchors landed, the residual is on the wire ...
        target = serve.proc.pid if paused == "prefill" else run.proc.pid
        stopped, resumed = _pause(target, PAUSE_S)  # ... when one node stops
        try:
            code = run.proc.wait(RUN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"lynx generate did not finish within {RUN_S:.0f} s{run.tail()}")
        assert code == 0, f"lynx generate exited with {code}{run.tail()}{_tail('lynx serve', serve.log_path)}"
    finally:
        run.close()
    out = json.loads(out_json.read_text())
    assert out["verified"] is True
    assert out["equal_to_int8"] is True
    assert out["tokens"] == out["int8_tokens"] and len(out["tokens"]) > 0
    # The pause fell inside the stream (the run's clock: the shared wall clock from the
    # prefill node's t0): regions had landed before it, residual regions landed after it,
    # and the timeline shows it: no region for seconds around it (a stopped node delivers
    # nothing; a loaded machine only widens the gap).
    t0 = out["t0_unix"]
    start, end = stopped - t0, resumed - t0
    arrivals = sorted(t for lane in out["arrivals_s"] for t in lane)
    assert any(t < start for t in arrivals), (start, end, out["arrivals_s"])
    assert any(t > end for lane in out["arrivals_s"][1:] for t in lane), (start, end, out["arrivals_s"])
    gap = max(b - a for a, b in itertools.pairwise(arrivals) if a < end and b > start)
    assert gap >= PAUSE_S - 1.0, (start, end, out["arrivals_s"])
