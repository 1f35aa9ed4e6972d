"""The KV stream header: round trip, hostile metadata, and model mismatch."""

from __future__ import annotations

import json
import zlib

import pytest

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.codec.layout import CacheLayout, LayerLayout
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.kvheader import KVHeader, region_name
from lynx_decode.model.protocol import ModelInfo
from lynx_decode.request import KVRequest, error_reply, parse_error_reply
from lynx_transport import Lane
from lynx_transport.errors import ConfigError

INFO = ModelInfo("m", num_layers=3, kv_heads=2, head_dim=16, max_positions=512,
                 vocab_size=100, eos_token_ids=frozenset({0}))


def _header(scheme: Scheme = Scheme.LYNX, tokens: int = 100, layers: int = 3) -> KVHeader:
    layer = LayerLayout.build(CodecConfig(scheme=scheme), 2, tokens - 1, 16)
    return KVHeader("req", "m", scheme, tokens, 123.5, CacheLayout.of([layer] * layers))


def test_header_round_trips_and_lists_anchor_regions_first() -> None:
    header = _header()
    back = KVHeader.from_metadata(header.to_metadata())
    assert back == header
    regions = back.regions()
    assert regions[0] == ("tokens", 400, int(Lane.ANCHOR))
    lanes = [lane for _, _, lane in regions]
    assert lanes == sorted(lanes)
    assert (region_name(2, 1), header.layout.layers[2].plane_size(1),
            int(Lane.RESIDUAL)) in regions
    assert back.check_model(INFO).tokens == 99


def test_non_speculative_schemes_have_no_residual_regions() -> None:
    for scheme in (Scheme.INT8, Scheme.INT4, Scheme.BF16):
        assert {lane for _, _, lane in _header(scheme).regions()} == {int(Lane.ANCHOR)}


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.update(format="other"), "not a Lynx KV header"),
    (lambda o: o.update(version=99), "version 99"),
    (lambda o: o.update(scheme="fp8"), "missing or invalid"),
    (lambda o: o.update(prompt_tokens=1), "prompt_tokens"),
    (lambda o: o.update(prompt_tokens=50), "needs 49"),
    (lambda o: o.pop("layout"), "missing or invalid"),
    (lambda o: o.update(layout="{}"), "layout"),
])
def test_bad_headers_are_rejected_with_a_reason(mutate, message) -> None:
    obj = json.loads(zlib.decompress(_header().to_metadata()))
    mutate(obj)
    with pytest.raises(LayoutError, match=message):
        KVHeader.from_metadata(zlib.compress(json.dumps(obj).encode()))


def test_garbage_and_zip_bombs_are_rejected() -> None:
    with pytest.raises(LayoutError, match="not compressed JSON"):
        KVHeader.from_metadata(b"\x00garbage")
    bomb = zlib.compress(b" " * (64 << 20), 9)
    assert len(bomb) < 128 * 1024
    with pytest.raises(LayoutError, match="inflates past"):
        KVHeader.from_metadata(bomb)


def test_stream_that_does_not_fit_the_model_is_refused() -> None:
    with pytest.raises(DecodeError, match=r"\(layers, kv_heads, head_dim\) = \(4, 2, 16\)"):
        _header(layers=4).check_model(INFO)
    with pytest.raises(DecodeError, match="more than the model's 512 positions"):
        _header(tokens=600).check_model(INFO)


def test_request_round_trip_and_validation() -> None:
    req = KVRequest("id", Scheme.LYNX, (3, 5), "chat", ("127.0.0.1", 5000), 1.5)
    assert KVRequest.from_metadata(req.to_metadata()) == req
    split = KVRequest("id", Scheme.LYNX, (2, 2, 4), "ids", ("127.0.0.1", 5000))
    assert KVRequest.from_metadata(split.to_metadata()).planes == (2, 2, 4)
    held = KVRequest("id", Scheme.LYNX, (3, 5), "chat", ("127.0.0.1", 5000), hold_residual=True)
    assert KVRequest.from_metadata(held.to_metadata()) == held
    raw = json.loads(req.to_metadata())
    del raw["hold_residual"]  # a requester that does not know the field: no hold
    assert KVRequest.from_metadata(json.dumps(raw).encode()).hold_residual is False
    with pytest.raises(DecodeError, match="hold_residual must be a boolean"):
        KVRequest.from_metadata(json.dumps({**raw, "hold_residual": "yes"}).encode())
    with pytest.raises(ConfigError, match="bandwidth"):
        KVRequest("id", Scheme.LYNX, (3, 5), "text", ("h", 1), 0.0)
    with pytest.raises(ConfigError, match="anchor"):
        KVRequest("id", Scheme.LYNX, (7, 1), "text", ("h", 1))
    with pytest.raises(ConfigError, match="sum to 9"):
        KVRequest("id", Scheme.LYNX, (4, 5), "text", ("h", 1))
    with pytest.raises(DecodeError, match="planes"):
        KVRequest.from_metadata(json.dumps({**raw, "planes": [4, 0, 4]}).encode())
    with pytest.raises(DecodeError, match="not a Lynx KV request"):
        KVRequest.from_metadata(b'{"format": "x"}')
    assert parse_error_reply(error_reply("id", "boom")) == ("id", "boom")
    assert parse_error_reply(_header().to_metadata()) is None
