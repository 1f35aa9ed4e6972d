"""Stream manifests: the named regions of a stream, their sizes and lanes, plus user metadata.

Encoding (network byte order), carried by an ``OPEN`` frame::

    stream_id u64 | chunk_bytes u32 | n_regions u32 | metadata_len u32
    n_regions x ( lane u8 | name_len u16 | size u64 | name utf-8 )
    metadata (opaque bytes, for the layer above, e.g. a KV layout descriptor)

:func:`decode_manifest` checks every count against :class:`ManifestLimits`
*before* it reads or allocates anything proportional to it, rejects unknown
lanes, duplicate or empty names, sizes past the limits, and trailing bytes.
Every failure is a :class:`~lynx_transport.errors.ManifestError`.
"""

from __future__ import annotations

import dataclasses
import functools
import struct

from lynx_transport.errors import ManifestError
from lynx_transport.lanes import MAX_LANES
from lynx_transport.protocol.scheduler import chunk_count
from lynx_transport.protocol.wire import CHUNK_BITS

__all__ = ["RegionSpec", "Manifest", "ManifestLimits", "encode_manifest", "decode_manifest"]

_HEAD = struct.Struct("!QIII")
_REGION = struct.Struct("!BHQ")

MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ManifestLimits:
    """What a receiver accepts. The defaults suit KV caches of long prompts."""

    max_regions: int = 4096
    max_name_bytes: int = 256
    max_metadata_bytes: int = 64 * 1024
    max_total_bytes: int = 1 << 40
    max_chunks: int = 1 << CHUNK_BITS

    def __post_init__(self) -> None:
        if not 1 <= self.max_chunks <= 1 << CHUNK_BITS:
            raise ValueError(f"max_chunks must be in [1, {1 << CHUNK_BITS}] (a chunk's index is "
                             f"the low {CHUNK_BITS} bits of its UCX tag), got {self.max_chunks}")

    @property
    def max_encoded_bytes(self) -> int:
        """Largest encoded manifest these limits allow (the OPEN frame limit)."""
        return (_HEAD.size + self.max_regions * (_REGION.size + self.max_name_bytes)
                + self.max_metadata_bytes)


@dataclasses.dataclass(frozen=True)
class RegionSpec:
    """A named region of ``nbytes`` bytes that travels on ``lane``."""

    name: str
    nbytes: int
    lane: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything the receiver learns about a stream before its data arrives."""

    stream_id: int
    chunk_bytes: int
    regions: tuple[RegionSpec, ...]
    metadata: bytes = b""

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @property
    def lanes(self) -> tuple[int, ...]:
        """The lanes that carry at least one region, in priority order."""
        return tuple(sorted({r.lane for r in self.regions}))

    def first_chunk_indices(self) -> tuple[int, ...]:
        """Index of each region's first chunk (chunks are numbered in manifest order)."""
        return self._first_chunks

    @functools.cached_property
    def _first_chunks(self) -> tuple[int, ...]:
        # computed once: the sender asks for it on every supplied region
        out, n = [], 0
        for r in self.regions:
            out.append(n)
            n += chunk_count(r.nbytes, self.chunk_bytes)
        return tuple(out)

    @property
    def chunk_total(self) -> int:
        return sum(chunk_count(r.nbytes, self.chunk_bytes) for r in self.regions)

    def validate(self, limits: ManifestLimits) -> None:
        """Raise :class:`ManifestError` unless the manifest is within ``limits``."""
        if not 0 <= self.stream_id < 1 << 64:
            raise ManifestError(f"stream id {self.stream_id} is out of range")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ManifestError(f"chunk size {self.chunk_bytes} outside "
                                f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if not self.regions:
            raise ManifestError("a manifest needs at least one region")
        if len(self.regions) > limits.max_regions:
            raise ManifestError(f"{len(self.regions)} regions exceed the limit of {limits.max_regions}")
        if len(self.metadata) > limits.max_metadata_bytes:
            raise ManifestError(f"metadata of {len(self.metadata)} bytes exceeds the limit of "
                                f"{limits.max_metadata_bytes}")
        seen: set[str] = set()
        total = 0
        for r in self.regions:
            raw = r.name.encode("utf-8") if isinstance(r.name, str) else b""
            if not raw or len(raw) > limits.max_name_bytes:
                raise ManifestError(f"region name {r.name!r} must be 1..{limits.max_name_bytes} "
                                    "utf-8 bytes")
            if r.name in seen:
                raise ManifestError(f"duplicate region name {r.name!r}")
            seen.add(r.name)
            if isinstance(r.lane, bool) or not isinstance(r.lane, int) or not 0 <= r.lane < MAX_LANES:
                raise ManifestError(f"region {r.name!r}: unknown lane {r.lane!r} "
                                    f"(lanes are 0..{MAX_LANES - 1})")
            if not isinstance(r.nbytes, int) or r.nbytes < 0:
                raise ManifestError(f"region {r.name!r}: size {r.nbytes!r} must be an int >= 0")
            total += r.nbytes
        if total > limits.max_total_bytes:
            raise ManifestError(f"stream of {total} bytes exceeds the limit of "
                                f"{limits.max_total_bytes}")
        if self.chunk_total > limits.max_chunks:
            raise ManifestError(f"stream of {self.chunk_total} chunks exceeds the limit of "
                                f"{limits.max_chunks}; use a larger chunk size")


def encode_manifest(manifest: Manifest, limits: ManifestLimits) -> bytes:
    """Validate against ``limits`` and encode."""
    manifest.validate(limits)
    parts = [_HEAD.pack(manifest.stream_id, manifest.chunk_bytes, len(manifest.regions),
                        len(manifest.metadata))]
    for r in manifest.regions:
        raw = r.name.encode("utf-8")
        parts.append(_REGION.pack(r.lane, len(raw), r.nbytes) + raw)
    parts.append(bytes(manifest.metadata))
    return b"".join(parts)


def decode_manifest(payload: bytes, limits: ManifestLimits) -> Manifest:
    """Parse and validate an encoded manifest; raise :class:`ManifestError` on anything wrong."""
    if len(payload) < _HEAD.size:
        raise ManifestError(f"truncated manifest ({len(payload)} bytes, header needs {_HEAD.size})")
    stream_id, chunk_bytes, n_regions, meta_len = _HEAD.unpack_from(payload)
    if n_regions > limits.max_regions:
        raise ManifestError(f"{n_regions} regions exceed the limit of {limits.max_regions}")
    if meta_len > limits.max_metadata_bytes:
        raise ManifestError(f"metadata of {meta_len} bytes exceeds the limit of "
                            f"{limits.max_metadata_bytes}")
    pos = _HEAD.size
    regions = []
    for i in range(n_regions):
        if pos + _REGION.size > len(payload):
            raise ManifestError(f"truncated manifest: region {i} header missing")
        lane, name_len, size = _REGION.unpack_from(payload, pos)
        pos += _REGION.size
        if name_len > limits.max_name_bytes:
            raise ManifestError(f"region {i}: name of {name_len} bytes exceeds the limit of "
                                f"{limits.max_name_bytes}")
        if pos + name_len > len(payload):
            raise ManifestError(f"truncated manifest: region {i} name missing")
        try:
            name = payload[pos:pos + name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError(f"region {i}: name is not valid utf-8") from None
        pos += name_len
        regions.append(RegionSpec(name, size, lane))
    if len(payload) - pos != meta_len:
        raise ManifestError(f"manifest length mismatch: {len(payload) - pos} bytes left for "
                            f"{meta_len} bytes of metadata")
    manifest = Manifest(stream_id, chunk_bytes, tuple(regions), bytes(payload[pos:]))
    manifest.validate(limits)
    return manifest
