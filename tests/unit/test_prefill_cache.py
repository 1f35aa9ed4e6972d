"""The on-disk prefill cache: exact round trips, misses for anything partial,
corrupt or foreign, and no torn reads under concurrent writers."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from lynx_decode.model import KVBuffers, KVShape, ModelInfo, Prefill
from lynx_decode.prefill_cache import PrefillCache

MODEL = "toy-model-0123"


def make_prefill(ids: Sequence[int], seed: int = 0, layers: int = 3) -> Prefill:
    rng = np.random.default_rng(seed)
    shape = KVShape(layers, 2, len(ids) - 1, 8)
    kv = KVBuffers.from_layers(
        [rng.standard_normal(shape.layer_shape, dtype=np.float32) for _ in range(layers)],
        [rng.standard_normal(shape.layer_shape, dtype=np.float32) for _ in range(layers)])
    return Prefill(tuple(ids), kv, prefill_s=1.25)


def test_round_trip_is_exact(tmp_path: Path) -> None:
    cache = PrefillCache(tmp_path)
    ids = list(range(10, 30))
    original = make_prefill(ids)
    cache.store(MODEL, original)
    loaded = cache.load(MODEL, ids)
    assert loaded is not None
    assert loaded.token_ids == tuple(ids)
    assert loaded.prefill_s == 1.25
    assert loaded.kv.complete
    np.testing.assert_array_equal(loaded.kv.keys, original.kv.keys)
    np.testing.assert_array_equal(loaded.kv.values, original.kv.values)


def test_load_with_headroom_keeps_values(tmp_path: Path) -> None:
    cache = PrefillCache(tmp_path)
    ids = list(range(7))
    original = make_prefill(ids, seed=3)
    cache.store(MODEL, original)
    loaded = cache.load(MODEL, ids, headroom=5)
    assert loaded is not None and loaded.kv.headroom == 5
    assert loaded.kv.storage_keys.shape[2] == len(ids) - 1 + 5
    np.testing.assert_array_equal(loaded.kv.keys, original.kv.keys)
    np.testing.assert_array_equal(loaded.kv.values, original.kv.values)


def test_other_prompt_or_model_misses(tmp_path: Path) -> None:
    cache = PrefillCache(tmp_path)
    ids = [5, 6, 7, 8]
    cache.store(MODEL, make_prefill(ids))
    assert cache.load(MODEL, [5, 6, 7, 9]) is None
    assert cache.load("other-model", ids) is None
    assert cache.load(MODEL, ids) is not None


def test_missing_directory_is_a_miss(tmp_path: Path) -> None:
    assert PrefillCache(tmp_path / "nope").load(MODEL, [1, 2, 3]) is None


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "extra", "empty",
                                    "garbage"])
def test_damaged_entry_is_a_miss_and_is_rewritten(tmp_path: Path, damage: str) -> None:
    cache = PrefillCache(tmp_path)
    ids = list(range(40))
    original = make_prefill(ids, seed=1)
    path = cache.store(MODEL, original)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip_payload":
        data[-7] ^= 0x10
    elif damage == "flip_header":
        data[20] ^= 0xFF
    elif damage == "extra":
        data += b"\0"
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"LYNXKV01\xff\xff\xff\xff" + b"x" * 50)
    path.write_bytes(bytes(data))
    assert cache.load(MODEL, ids) is None

    cache.store(MODEL, original)  # what get_or_prefill does after a miss
    loaded = cache.load(MODEL, ids)
    assert loaded is not None
    np.testing.assert_array_equal(loaded.kv.values, original.kv.values)


class CountingModel:
    """A tiny deterministic CausalLM stand-in: K/V are a function of the ids."""

    def __init__(self) -> None:
        self.prefills = 0
        self.info = ModelInfo("counting", 2, 1, 4, 64, 100, frozenset({0}))

    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        self.prefills += 1
        ids = np.asarray(token_ids[:-1], dtype=np.float32)
        layer = np.broadcast_to(ids[None, :, None], (1, len(ids), 4))
        return Prefill(tuple(token_ids), KVBuffers.from_layers([layer] * 2, [-layer] * 2), 0.5)


def test_get_or_prefill_prefills_once(tmp_path: Path) -> None:
    cache = PrefillCache(tmp_path)
    model = CountingModel()
    first = cache.get_or_prefill(model, [3, 4, 5, 6])  # type: ignore[arg-type]
    second = cache.get_or_prefill(model, [3, 4, 5, 6], headroom=4)  # type: ignore[arg-type]
    assert (first.hit, second.hit, model.prefills) == (False, True, 1)
    np.testing.assert_array_equal(second.prefill.kv.keys, first.prefill.kv.keys)
    assert second.prefill.kv.headroom == 4


def _writer(root: str, seed: int, rounds: int) -> None:
    cache = PrefillCache(Path(root))
    prefill = make_prefill(list(range(300)), seed=0, layers=4)
    for _ in range(rounds):
        cache.store(MODEL, prefill)


def test_concurrent_writers_never_expose_a_torn_entry(tmp_path: Path) -> None:
    expected = make_prefill(list(range(300)), seed=0, layers=4)
    cache = PrefillCache(tmp_path)
    cache.store(MODEL, expected)
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), i, 15)) for i in range(2)]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers) or reads == 0:
        # The entry exists throughout and is replaced atomically: every read hits.
        got = cache.load(MODEL, list(range(300)))
        assert got is not None
        np.testing.assert_array_equal(got.kv.keys, expected.kv.keys)
        reads += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_header_claiming_a_huge_cache_is_a_miss_without_allocating(tmp_path: Path) -> None:
    import json
    import struct

    cache = PrefillCache(tmp_path)
    ids = [1, 2, 3]
    path = cache.store(MODEL, make_prefill(ids))
    data = path.read_bytes()
    (size,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12:12 + size])
    header["shape"] = [1000, 1000, 2, 1 << 20]  # 16 TB if anyone believed it
    header["payload_bytes"] = 2 * 1000 * 1000 * 2 * (1 << 20) * 4
    raw = json.dumps(header).encode()
    path.write_bytes(data[:8] + struct.pack("<I", len(raw)) + raw + data[12 + size:])
    assert cache.load(MODEL, ids) is None
