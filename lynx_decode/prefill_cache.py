"""Prefilled KV caches kept on disk, so repeated runs of a prompt skip prefill.

An entry holds the native float32 cache that :meth:`CausalLM.prefill` returns
(the cache of ``token_ids[:-1]``), keyed by ``(model_id, token ids)``. Encoded
forms are not stored: encoding a cache with any scheme is fast next to prefill,
and one entry then serves every scheme and anchor width.

File format (little endian), one file per entry, ``<root>/<key>.kv``::

    b"LYNXKV01" | u32 header length | JSON header | K [L,H,T,D] f32 | V [L,H,T,D] f32

The header records the model id, a SHA-256 of the token ids, the shape, the
payload size and its CRC-32. Writes go to a temporary file in the same
directory, are fsync'ed and renamed over the entry with ``os.replace``, so
readers see either a complete old entry or a complete new one and concurrent
writers of the same prompt cannot corrupt it (the last rename wins; both wrote
the same content). A short, corrupt or mismatched file is treated as a miss and
rewritten by the next :meth:`PrefillCache.get_or_prefill`. Entries are never
evicted automatically; delete the directory to reclaim space. A model whose
layers differ in heads or head size is not cached (the format holds one shape);
sliding-window layers are stored whole, as the prefill computes them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lynx_decode.errors import DecodeError
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import CausalLM, Prefill
from lynx_decode.model.store import cache_root

__all__ = ["PrefillCache", "CachedPrefill"]

MAGIC = b"LYNXKV01"
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


@dataclass(frozen=True)
class CachedPrefill:
    """A prefill result and whether it came from disk (``prefill_s`` is then the
    time the original prefill took, as recorded in the entry)."""

    prefill: Prefill
    hit: bool


class PrefillCache:
    """A directory of prefilled caches (default ``<cache root>/prefill``)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_root() / "prefill"

    def path(self, model_id: str, token_ids: Sequence[int]) -> Path:
        key = hashlib.sha256(model_id.encode() + b"\0" + _ids_digest(token_ids).encode())
        return self.root / f"{key.hexdigest()[:32]}.kv"

    def load(self, model_id: str, token_ids: Sequence[int], *,
             headroom: int = 0) -> Prefill | None:
        """The stored cache, or None when absent, partial, corrupt or for other ids."""
        try:
            with self.path(model_id, token_ids).open("rb") as f:
                return _read(f, model_id, token_ids, headroom)
        except (OSError, ValueError, KeyError, TypeError, struct.error, DecodeError):
            return None

    def store(self, model_id: str, prefill: Prefill) -> Path:
        """Write ``prefill`` atomically; returns the entry's path."""
        kv = prefill.kv
        if not kv.complete:
            raise DecodeError(f"cannot store a cache with missing layers {kv.missing_layers()}")
        dest = self.path(model_id, prefill.token_ids)
        keys = np.ascontiguousarray(kv.keys, dtype="<f4")
        values = np.ascontiguousarray(kv.values, dtype="<f4")
        crc = zlib.crc32(values.data, zlib.crc32(keys.data))
        header = json.dumps({
            "model_id": model_id, "ids_sha256": _ids_digest(prefill.token_ids),
            "num_ids": len(prefill.token_ids),
            "shape": [kv.shape.num_layers, kv.shape.kv_heads, kv.shape.tokens, kv.shape.head_dim],
            "payload_bytes": keys.nbytes + values.nbytes, "crc32": crc,
            "prefill_s": prefill.prefill_s,
        }).encode()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".kv", dir=self.root)
        except OSError as exc:
            raise DecodeError(f"cannot write the prefill cache under {self.root}: {exc}") from exc
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(keys.data)
                f.write(values.data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            _fsync_dir(self.root)
        except OSError as exc:
            raise DecodeError(f"cannot write the prefill cache entry {dest}: {exc}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest

    def get_or_prefill(self, model: CausalLM, token_ids: Sequence[int], *,
                       headroom: int = 0) -> CachedPrefill:
        """Load the entry for ``token_ids``, or prefill, store and return it."""
        ids = [int(t) for t in token_ids]
        model_id = model.info.model_id
        cached = self.load(model_id, ids, headroom=headroom)
        if cached is not None:
            return CachedPrefill(cached, hit=True)
        fresh = model.prefill(ids)
        if fresh.kv.shape.uniform:  # layers of different heads or head sizes are not kept on disk
            self.store(model_id, fresh)
        if headroom:
            kv = KVBuffers(fresh.kv.shape, headroom=headroom)
            kv.keys[...] = fresh.kv.keys
            kv.values[...] = fresh.kv.values
            for i in range(kv.shape.num_layers):
                kv.mark_written(i)
            fresh = Prefill(fresh.token_ids, kv, fresh.prefill_s)
        return CachedPrefill(fresh, hit=False)


def _read(f: io.BufferedReader, model_id: str, token_ids: Sequence[int], headroom: int) -> Prefill | None:
    if f.read(len(MAGIC)) != MAGIC:
        return None
    (size,) = _LEN.unpack(f.read(_LEN.size))
    if size > MAX_HEADER:
        return None
    header = json.loads(f.read(size))
    ids = tuple(int(t) for t in token_ids)
    if (header["model_id"] != model_id or header["ids_sha256"] != _ids_digest(ids)
            or header["num_ids"] != len(ids)):
        return None
    layers, heads, covered, dim = (int(x) for x in header["shape"])
    shape = KVShape(layers, heads, covered, dim)
    if shape.tokens != len(ids) - 1:
        return None
    half = shape.num_layers * shape.kv_heads * shape.tokens * shape.head_dim * 4
    remaining = os.fstat(f.fileno()).st_size - f.tell()
    if header["payload_bytes"] != 2 * half or remaining != 2 * half:
        return None  # checked before allocating anything the header asks for
    kv = KVBuffers(shape, headroom=headroom)
    crc = 0
    for dst in (kv.keys, kv.values):
        block = dst if dst.flags.c_contiguous else np.empty(dst.shape, dtype="<f4")
        if f.readinto(block.data.cast("B")) != half:
            return None
        crc = zlib.crc32(block.data, crc)
        if block is not dst:
            dst[...] = block
    if f.read(1) or crc != header["crc32"]:
        return None
    for i in range(shape.num_layers):
        kv.mark_written(i)
    return Prefill(ids, kv, float(header["prefill_s"]))


def _ids_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(list(token_ids), dtype="<i8").tobytes()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
