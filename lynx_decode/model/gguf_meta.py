"""Read one metadata value from a GGUF file's header without loading the model.

GGUF (v2/v3) header: magic ``GGUF``, u32 version, u64 tensor count, u64 key-value
count, then key-value pairs (key: u64 length + UTF-8; value: u32 type + payload).
Only the key-value section is walked, and only until the key is found, so this
takes milliseconds where a full reader takes seconds.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from lynx_decode.errors import ModelError

__all__ = ["gguf_value", "gguf_context_length"]

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 1 << 16
_MAX_LEN = 1 << 30


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ModelError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> bytes:
    n = _read(f, "<Q")
    if n > _MAX_LEN:
        raise ModelError("corrupt GGUF header (string length)")
    data = f.read(n)
    if len(data) != n:
        raise ModelError("truncated GGUF header")
    return data


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f).decode("utf-8", "replace")
    if vtype == _ARRAY:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if count > _MAX_LEN:
            raise ModelError("corrupt GGUF header (array length)")
        if item_type in _SCALARS:  # skip without decoding
            f.seek(struct.calcsize(_SCALARS[item_type]) * count, 1)
        else:
            for _ in range(count):
                _value(f, item_type)
        return None
    raise ModelError(f"unknown GGUF value type {vtype}")


def gguf_value(path: Path, key: str) -> Any:
    """The value of ``key`` in the GGUF header (arrays are not returned)."""
    try:
        with Path(path).open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"{path} is not a GGUF file")
            if _read(f, "<I") not in (2, 3):
                raise ModelError(f"{path}: unsupported GGUF version")
            _tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            for _ in range(min(n_kv, _MAX_KEYS)):
                name = _string(f).decode("utf-8", "replace")
                value = _value(f, _read(f, "<I"))
                if name == key:
                    return value
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    raise ModelError(f"{path} has no {key!r} in its header")


def gguf_context_length(path: Path) -> int:
    """The model's context window (``{architecture}.context_length``)."""
    arch = gguf_value(path, "general.architecture")
    return int(gguf_value(path, f"{arch}.context_length"))
