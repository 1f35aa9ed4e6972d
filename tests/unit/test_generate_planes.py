"""`lynx generate --planes W,W[,W]`: one LYNX split, validated before the model loads,
mutually exclusive with --anchor-bits (which keeps working as before); neither: auto."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lynx_bench import cli
from lynx_bench.nodes import generate
from lynx_transport.errors import ConfigError


def _args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(["--connect", "127.0.0.1:1", "--prompt-file", str(prompt),
                              "--json", str(tmp_path / "o.json"), *flags])


@pytest.mark.parametrize(("flags", "split"), [
    ((), "auto"),
    (("--anchor-bits", "3"), (3, 5)),
    (("--planes", "4,4"), (4, 4)),
    (("--planes", "2,2,4"), (2, 2, 4)),
    (("--anchor-bits", "auto"), "auto"),
    (("--planes", "auto"), "auto"),
])
def test_the_split_the_flags_ask_for(tmp_path: Path, flags: tuple[str, ...], split: tuple[int, ...]) -> None:
    assert generate.split_from_args(_args(tmp_path, *flags)) == split


@pytest.mark.parametrize(("planes", "message"), [
    ("3,4", "--planes: planes 3,4 sum to 7 bits"),
    ("4,0,4", "--planes: planes 4,0,4: every plane needs at least 1 bit"),
    ("7,1", "--planes: planes 7,1: the anchor"),
    ("four", "--planes: planes must be comma-separated"),
])
def test_a_bad_split_fails_before_the_model_loads(tmp_path: Path, planes: str, message: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model(args: argparse.Namespace) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(generate, "load_model", no_model)
    with pytest.raises(ConfigError, match=message):
        generate.run(_args(tmp_path, "--planes", planes))
    prompt = tmp_path / "prompt.txt"
    rc = cli.main(["generate", "--connect", "127.0.0.1:1", "--prompt-file", str(prompt),
                   "--json", str(tmp_path / "o.json"), "--planes", planes])
    assert rc == 2
    assert "lynx: error: --planes: planes" in capsys.readouterr().err


def test_planes_and_anchor_bits_are_mutually_exclusive(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _args(tmp_path, "--planes", "2,2,4", "--anchor-bits", "3")
