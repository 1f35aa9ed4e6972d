"""Bad sweep arguments are rejected with a clear error before any work starts."""

from pathlib import Path

import pytest

from lynx_bench.sweep_config import QUICK, SweepConfig, parse_floats
from lynx_transport.errors import ConfigError


def test_quick_preset_is_valid(tmp_path: Path) -> None:
    assert QUICK.__class__(**{**QUICK.__dict__, "out": tmp_path}).validate(8192)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bandwidths_gbps": (1.0, 0.0)}, "not a positive"),
        ({"bandwidths_gbps": (-2.0,)}, "not a positive"),
        ({"bandwidths_gbps": (float("nan"),)}, "not a positive"),
        ({"schemes": ("lynx", "fp8")}, "unknown scheme 'fp8'"),
        ({"contexts": (8192,)}, "exceeds the model's context window of 8192"),
        ({"anchor_bits": 7}, "--anchor-bits"),
        ({"repeats": 0}, "--repeats"),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SweepConfig(out=tmp_path, **changes).validate(max_context=8192)


def test_unwritable_out_is_rejected(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--out: cannot write"):
        SweepConfig(out=blocker / "sub").validate()


def test_parse_floats_names_flag() -> None:
    assert parse_floats("0.5,1,2", "--bandwidths") == (0.5, 1.0, 2.0)
    with pytest.raises(ConfigError, match="--bandwidths"):
        parse_floats("1,fast", "--bandwidths")
