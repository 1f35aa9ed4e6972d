"""Manifests: round trip, strict validation, no allocation proportional to claimed sizes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_transport.errors import ManifestError
from lynx_transport.lanes import MAX_LANES, Lane
from lynx_transport.protocol.manifest import Manifest, ManifestLimits, RegionSpec, decode_manifest, encode_manifest

LIMITS = ManifestLimits()

names = st.text(min_size=1, max_size=20).filter(lambda s: len(s.encode()) <= 256)


@settings(max_examples=60, deadline=None)
@given(specs=st.dictionaries(names, st.tuples(st.integers(0, 1 << 30), st.integers(0, MAX_LANES - 1)),
                             min_size=1, max_size=10),
       metadata=st.binary(max_size=200), stream_id=st.integers(0, (1 << 64) - 1))
def test_round_trip(specs: dict, metadata: bytes, stream_id: int) -> None:
    m = Manifest(stream_id, 1 << 20, tuple(RegionSpec(n, s, lane) for n, (s, lane) in specs.items()),
                 metadata)
    assert decode_manifest(encode_manifest(m, LIMITS), LIMITS) == m


def good() -> Manifest:
    return Manifest(1, 65536, (RegionSpec("k", 100, Lane.ANCHOR), RegionSpec("v", 200, Lane.RESIDUAL)),
                    b"layout")


def test_chunk_numbering_follows_manifest_order() -> None:
    m = Manifest(1, 4096, (RegionSpec("a", 10000, 1), RegionSpec("b", 0, 0), RegionSpec("c", 1, 0)))
    assert m.first_chunk_indices() == (0, 3, 3)
    assert m.chunk_total == 4 and m.lanes == (0, 1)


@pytest.mark.parametrize(("manifest", "message"), [
    (Manifest(1, 65536, ()), "at least one region"),
    (Manifest(1, 65536, (RegionSpec("a", 1, 0), RegionSpec("a", 1, 1))), "duplicate"),
    (Manifest(1, 65536, (RegionSpec("", 1, 0),)), "name"),
    (Manifest(1, 65536, (RegionSpec("a", 1, MAX_LANES),)), "unknown lane"),
    (Manifest(1, 65536, (RegionSpec("a", -1, 0),)), "size"),
    (Manifest(1, 100, (RegionSpec("a", 1, 0),)), "chunk size"),
    (Manifest(1, 65536, (RegionSpec("a", 1 << 41, 0),)), "exceeds the limit"),
    (Manifest(1, 65536, (RegionSpec("a", 1, 0),), b"x" * (LIMITS.max_metadata_bytes + 1)), "metadata"),
    (Manifest(1, 4096, (RegionSpec("a", 4096 * (LIMITS.max_chunks + 1), 0),)), "chunks"),
])
def test_invalid_manifests_are_refused_on_encode(manifest: Manifest, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        encode_manifest(manifest, LIMITS)


def raw_head(stream_id: int, chunk: int, n_regions: int, meta_len: int) -> bytes:
    return struct.pack("!QIII", stream_id, chunk, n_regions, meta_len)


@pytest.mark.parametrize(("payload", "message"), [
    (b"\x00" * 5, "truncated manifest"),
    (raw_head(1, 65536, 0xFFFFFFFF, 0), "regions exceed"),
    (raw_head(1, 65536, 1, 0xFFFFFFFF), "metadata"),
    (raw_head(1, 65536, 2, 0) + struct.pack("!BHQ", 0, 1, 5) + b"a", "region 1 header missing"),
    (raw_head(1, 65536, 1, 0) + struct.pack("!BHQ", 0, 60000, 5), "name of 60000"),
    (raw_head(1, 65536, 1, 0) + struct.pack("!BHQ", 0, 10, 5) + b"abc", "name missing"),
    (raw_head(1, 65536, 1, 0) + struct.pack("!BHQ", 0, 2, 5) + b"\xff\xfe", "utf-8"),
    (raw_head(1, 65536, 1, 0) + struct.pack("!BHQ", 9, 1, 5) + b"a", "unknown lane"),
    (raw_head(1, 65536, 1, 0) + struct.pack("!BHQ", 0, 1, 5) + b"a" + b"junk", "length mismatch"),
    (raw_head(1, 65536, 1, 0) + struct.pack("!BHQ", 0, 1, (1 << 64) - 1) + b"a", "exceeds"),
])
def test_hostile_payloads_are_manifest_errors(payload: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        decode_manifest(payload, LIMITS)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_mutated_manifests_raise_only_manifest_error(data: st.DataObject) -> None:
    raw = bytearray(encode_manifest(good(), LIMITS))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        m = decode_manifest(bytes(raw[:cut]), LIMITS)
    except ManifestError:
        return
    m.validate(LIMITS)  # anything accepted is within the limits
