"""The GGUF header reader finds values without loading the model, and rejects junk."""

import struct
from pathlib import Path

import pytest

from lynx_decode.errors import ModelError
from lynx_decode.model.gguf_meta import gguf_context_length, gguf_value


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf(tmp_path: Path) -> Path:
    kv = [
        _s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
        _s("tokenizer.tokens") + struct.pack("<IIQ", 9, 8, 2) + _s("a") + _s("bc"),
        _s("tokenizer.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 1, 2, 3),
        _s("llama.context_length") + struct.pack("<II", 4, 4096),
    ]
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
    return path


def test_reads_values_past_arrays(tmp_path: Path) -> None:
    path = _gguf(tmp_path)
    assert gguf_value(path, "general.architecture") == "llama"
    assert gguf_context_length(path) == 4096


def test_missing_key_and_junk_are_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no 'x.y'"):
        gguf_value(_gguf(tmp_path), "x.y")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + b"\0" * 20)
    with pytest.raises(ModelError, match="not a GGUF file"):
        gguf_value(junk, "a")
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(_gguf(tmp_path).read_bytes()[:40])
    with pytest.raises(ModelError, match="truncated"):
        gguf_value(truncated, "llama.context_length")
