"""Read one metadata value from a GGUF file's header without loading the model,
and check that a GGUF file is whole.

GGUF (v2/v3) header: magic ``GGUF``, u32 version, u64 tensor count, u64 key-value
count, then key-value pairs (key: u64 length + UTF-8; value: u32 type + payload),
then one info per tensor (name, u32 dims, u64 per dim, u32 ggml type, u64 offset
into the data section), the data section starting at the next multiple of
``general.alignment`` (default 32). Only the header is walked, so this takes
milliseconds where a full reader takes seconds.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from lynx_decode.errors import ModelError

__all__ = ["gguf_value", "gguf_context_length", "gguf_expected_size", "check_gguf"]

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


def _counts(f: BinaryIO, path: Path) -> tuple[int, int]:
    """Check a GGUF file's magic and version; its ``(tensors, keys)`` counts."""
    if f.read(4) != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    if _read(f, "<I") not in (2, 3):
        raise ModelError(f"{path}: unsupported GGUF version")
    return _read(f, "<Q"), _read(f, "<Q")


def _items(f: BinaryIO, n: int) -> Iterator[tuple[str, Any]]:
    """The next ``n`` header entries as ``(key, value)`` (arrays as None)."""
    for _ in range(n):
        yield _string(f).decode("utf-8", "replace"), _value(f, _read(f, "<I"))


def gguf_value(path: Path, key: str) -> Any:
    """The value of ``key`` in the GGUF header (arrays are not returned)."""
    try:
        with Path(path).open("rb") as f:
            _tensors, n_kv = _counts(f, path)
            for name, value in _items(f, min(n_kv, _MAX_KEYS)):
                if name == key:
                    return value
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    raise ModelError(f"{path} has no {key!r} in its header")


def gguf_context_length(path: Path) -> int:
    """The model's context window (``{architecture}.context_length``)."""
    arch = gguf_value(path, "general.architecture")
    return int(gguf_value(path, f"{arch}.context_length"))


_DEFAULT_ALIGNMENT = 32
_MAX_TENSORS = 1 << 20


def _type_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (values per block, bytes per block), from the ``gguf`` package."""
    try:
        from gguf.constants import GGML_QUANT_SIZES  # noqa: PLC0415 - optional (the model extra)
    except ImportError as exc:
        raise ModelError(f"checking a GGUF file needs `gguf` (pip install 'lynx-kv[model]'): {exc}") from exc
    return {int(k): (int(b), int(t)) for k, (b, t) in GGML_QUANT_SIZES.items()}


def gguf_expected_size(path: Path) -> int:
    """The size in bytes a whole GGUF file at ``path`` has: its data section's start
    plus the end of its last tensor (:class:`ModelError` when the header itself is cut
    short or malformed)."""
    sizes = _type_sizes()
    try:
        with Path(path).open("rb") as f:
            n_tensors, n_kv = _counts(f, path)
            if n_kv > _MAX_KEYS or n_tensors > _MAX_TENSORS:
                raise ModelError(f"{path}: corrupt GGUF header ({n_kv} keys, {n_tensors} tensors)")
            alignment = _DEFAULT_ALIGNMENT
            for name, value in _items(f, n_kv):
                if name == "general.alignment" and isinstance(value, int) and value > 0:
                    alignment = value
            end = 0
            for _ in range(n_tensors):
                tname = _string(f).decode("utf-8", "replace")
                n_dims = _read(f, "<I")
                if n_dims > 8:
                    raise ModelError(f"{path}: corrupt GGUF tensor info ({tname}: {n_dims} dims)")
                count = 1
                for _ in range(n_dims):
                    count *= _read(f, "<Q")
                ggml_type, offset = _read(f, "<I"), _read(f, "<Q")
                if ggml_type not in sizes:
                    raise ModelError(f"{path}: tensor {tname} has an unknown ggml type {ggml_type}")
                block, nbytes = sizes[ggml_type]
                end = max(end, offset + -(-count // block) * nbytes)
            start = -(-f.tell() // alignment) * alignment
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    return start + end


def check_gguf(path: Path) -> None:
    """:class:`ModelError` unless ``path`` is a whole GGUF file: not GGUF, a header
    cut short, or fewer bytes than its tensors need ("truncated", with both sizes)."""
    actual = Path(path).stat().st_size
    try:
        expected = gguf_expected_size(path)
    except ModelError as exc:
        if "truncated" in str(exc):
            raise ModelError(f"the GGUF file {path} is truncated: its header ends early "
                             f"({actual} bytes)") from None
        raise
    if actual < expected:
        raise ModelError(f"the GGUF file {path} is truncated: its tensors need {expected} bytes, "
                         f"the file has {actual} ({expected - actual} missing)")
