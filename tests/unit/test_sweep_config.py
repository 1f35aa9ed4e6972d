"""Bad sweep arguments are rejected with a clear error before any work starts, and
the LYNX splits (``--anchor-bits 4,3``, ``--planes 4,4 2,2,4``) become named schemes."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from lynx_bench.sweep.cli import _jobs, _request, add_arguments, config_from_args
from lynx_bench.sweep.config import (
    QUICK,
    SweepConfig,
    SweepScheme,
    is_lynx,
    lynx_scheme_name,
    parse_floats,
    parse_planes_flag,
)
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
        ({"schemes": ("lynx", "int8", "lynx")}, "--schemes: lynx is listed twice"),
        ({"contexts": (8192,)}, "exceeds the model's context window of 8192"),
        ({"anchor_bits": (7,)}, "--anchor-bits: anchor bits must be in 2..6, got 7"),
        ({"anchor_bits": (4, 1)}, "--anchor-bits: anchor bits must be in 2..6, got 1"),
        ({"anchor_bits": ()}, "--anchor-bits: give at least one split"),
        ({"anchor_bits": (4, 4)}, "--anchor-bits: the split 4,4 is listed twice"),
        ({"planes": ((4, 4), (3, 3))}, "--planes: planes 3,3 sum to 6 bits"),
        ({"planes": ((4, 0, 4),)}, "--planes: planes 4,0,4: every plane needs at least 1 bit"),
        ({"planes": ((1, 7),)}, "--planes: planes 1,7: the anchor"),
        ({"planes": ((2, 2, 4), (2, 2, 4))}, "--planes: the split 2,2,4 is listed twice"),
        ({"planes": ((4, 4),), "anchor_bits": (3,)}, "mutually exclusive"),
        ({"planes": ((2, 2, 4),), "schemes": ("int8", "int4")}, "--planes: .* lynx is not among --schemes"),
        ({"repeats": 0}, "--repeats"),
        ({"schemes": ("int8", "lynx-9")}, "unknown scheme 'lynx-9'"),
        ({"schemes": ("int8", "lynx-4.4.4")}, "unknown scheme 'lynx-4.4.4'"),
        ({"schemes": ("lynx-auto", "lynx-auto")}, "lynx-auto is listed twice"),
        ({"schemes": ("lynx", "lynx-3"), "anchor_bits": (3,)}, "lynx-3 would run twice"),
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


def test_parse_planes_flag_names_flag_and_reason() -> None:
    assert parse_planes_flag(["4,4", "2,2,4"]) == ((4, 4), (2, 2, 4))
    with pytest.raises(ConfigError, match=r"^--planes: planes 2,2,2 sum to 6 bits"):
        parse_planes_flag(["4,4", "2,2,2"])
    with pytest.raises(ConfigError, match=r"^--planes: planes must be comma-separated"):
        parse_planes_flag(["4;4"])


# -- naming: the default split alone stays `lynx`; otherwise lynx-<planes_name> ------------


@pytest.mark.parametrize(("changes", "names"), [
    ({}, ("bf16", "int8", "int4", "lynx")),
    ({"anchor_bits": (4,)}, ("bf16", "int8", "int4", "lynx")),
    ({"planes": ((4, 4),)}, ("bf16", "int8", "int4", "lynx")),
    ({"anchor_bits": (3,)}, ("bf16", "int8", "int4", "lynx-3")),
    ({"anchor_bits": (4, 3)}, ("bf16", "int8", "int4", "lynx-4", "lynx-3")),
    ({"planes": ((4, 4), (2, 2, 4))}, ("bf16", "int8", "int4", "lynx-4", "lynx-2.2.4")),
    ({"planes": ((2, 2, 4),), "schemes": ("lynx", "int8")}, ("lynx-2.2.4", "int8")),
])
def test_scheme_names(tmp_path: Path, changes: dict, names: tuple[str, ...]) -> None:
    config = SweepConfig(out=tmp_path, **changes).validate()
    assert tuple(s.name for s in config.sweep_schemes) == names
    assert config.to_json()["sweep_schemes"] == list(names)
    for s in config.sweep_schemes:
        assert is_lynx(s.name) == (s.scheme == "lynx") == (s.planes is not None)


def test_lynx_scheme_name_and_is_lynx() -> None:
    assert lynx_scheme_name((4, 4), ((4, 4),)) == "lynx"
    assert lynx_scheme_name((4, 4), ((4, 4), (3, 5))) == "lynx-4"
    assert lynx_scheme_name((3, 5), ((3, 5),)) == "lynx-3"
    assert lynx_scheme_name((2, 2, 4), ((2, 2, 4),)) == "lynx-2.2.4"
    assert [is_lynx(s) for s in ("lynx", "lynx-3", "lynx-2.2.4", "int8", "lynxish")] == [
        True, True, True, False, False]


# -- the command line --------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_give_the_splits(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path)]
    assert config_from_args(_args(*out)).splits == ((4, 4),)
    assert config_from_args(_args("--anchor-bits", "3", *out)).splits == ((3, 5),)
    assert config_from_args(_args("--anchor-bits", "4,3", *out)).splits == ((4, 4), (3, 5))
    config = config_from_args(_args("--planes", "4,4", "2,2,4", *out))
    assert config.splits == ((4, 4), (2, 2, 4))
    assert config.to_json()["splits"] == [[4, 4], [2, 2, 4]]


@pytest.mark.parametrize(("argv", "message"), [
    (["--planes", "4,4", "3,4"], "--planes: planes 3,4 sum to 7 bits"),
    (["--planes", "8"], "--planes: planes 8: a split needs at least 2 planes"),
    (["--planes", "1,1,1,1,1,1,1,1"], "--planes: .*lanes"),
    (["--anchor-bits", "4,x"], "--anchor-bits: expected comma-separated integers"),
    (["--anchor-bits", "4,8"], "--anchor-bits: anchor bits must be in 2..6, got 8"),
])
def test_bad_split_flags_are_named(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_args(_args(*argv, "--out", str(tmp_path)))


def test_planes_and_anchor_bits_are_mutually_exclusive() -> None:
    with pytest.raises(SystemExit):
        _args("--planes", "4,4", "--anchor-bits", "3")


def test_every_split_runs_interleaved_and_the_worker_gets_its_planes(tmp_path: Path) -> None:
    config = dataclasses.replace(QUICK, out=tmp_path, bandwidths_gbps=(1.0,), repeats=2,
                                 schemes=("bf16", "int8", "int4", "lynx"), planes=((4, 4), (2, 2, 4))).validate()
    jobs = _jobs(config, config.bandwidths_gbps)
    assert [(j.repeat, j.scheme) for j in jobs] == [
        (r, s) for r in range(2) for s in ("bf16", "int8", "int4", "lynx-4", "lynx-2.2.4")]
    by_name = {j.scheme: _request(config, j) for j in jobs}
    assert by_name["lynx-2.2.4"]["scheme"] == "lynx" and by_name["lynx-2.2.4"]["planes"] == [2, 2, 4]
    assert by_name["lynx-4"]["scheme"] == "lynx" and by_name["lynx-4"]["planes"] == [4, 4]
    assert by_name["int8"]["scheme"] == "int8" and by_name["int8"]["planes"] is None
    assert SweepScheme("lynx-4", "lynx", (4, 4)) in config.sweep_schemes


def test_references_are_decoded_when_the_baselines_are_not_swept(tmp_path: Path) -> None:
    config = dataclasses.replace(QUICK, out=tmp_path, schemes=("lynx",), anchor_bits=(4, 3)).validate()
    jobs = _jobs(config, (1.0, 10.0))
    assert [(j.scheme, j.recorded) for j in jobs if not j.recorded] == [("int8", False), ("bf16", False)]
    assert [j.scheme for j in jobs if j.recorded] == ["lynx-4", "lynx-3"] * 2


def test_schemes_name_splits_and_auto_and_the_worker_hears_auto(tmp_path: Path) -> None:
    config = SweepConfig(out=tmp_path, bandwidths_gbps=(1.0,), repeats=1, prompts=1,
                         schemes=("int8", "lynx-auto", "lynx-4", "lynx-3", "lynx-2.2.4")).validate()
    assert config.sweep_schemes == (
        SweepScheme("int8", "int8"), SweepScheme("lynx-auto", "lynx", auto=True),
        SweepScheme("lynx-4", "lynx", (4, 4)), SweepScheme("lynx-3", "lynx", (3, 5)),
        SweepScheme("lynx-2.2.4", "lynx", (2, 2, 4)))
    requests = {j.scheme: _request(config, j) for j in _jobs(config, config.bandwidths_gbps) if j.recorded}
    assert requests["lynx-auto"]["scheme"] == "lynx" and requests["lynx-auto"]["planes"] == "auto"
    assert requests["lynx-3"]["planes"] == [3, 5]


def test_the_demo_shows_auto_beside_the_fixed_split_and_split_flags_replace_them(tmp_path: Path) -> None:
    assert [s.name for s in QUICK.sweep_schemes] == ["bf16", "int8", "int4", "lynx-auto", "lynx-4"]
    config = config_from_args(_args("--quick", "--planes", "4,4", "2,2,4", "--out", str(tmp_path)))
    assert [s.name for s in config.sweep_schemes] == ["bf16", "int8", "int4", "lynx-4", "lynx-2.2.4"]
