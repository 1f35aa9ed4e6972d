"""The one-time GGUF conversion says so: one INFO line with an estimate as it starts,
one with the time taken when done, nothing once the model is cached; and the
``lynx`` CLI shows those lines by default (every subcommand, not only ``serve``).

The conversion itself is replaced by a fake (the real one takes ~25 s and needs
torch), and the cache root is a temporary directory (never the user's cache).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from lynx_bench.cli import SHOWN_AT_INFO, SUBCOMMANDS, configure_logging
from lynx_decode.errors import ModelError
from lynx_decode.model import store

MiB = 1 << 20


def _gguf(tmp_path: Path, mib: int = 1) -> Path:
    path = tmp_path / "toy.gguf"
    with path.open("wb") as f:
        f.truncate(mib * MiB)  # sparse: only the size matters to the estimate
    return path


def _store_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == store.__name__]


def test_a_conversion_logs_its_start_with_an_estimate_and_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    converted: list[Path] = []

    def fake_convert(gguf: Path, out: Path) -> None:
        # the start line is out before the (long) conversion begins
        assert any("converting the model" in line for line in _store_lines(caplog))
        (out / "config.json").write_text("{}")
        converted.append(gguf)

    monkeypatch.setattr(store, "_convert", fake_convert)
    gguf = _gguf(tmp_path)
    root = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger=store.__name__):
        dest = store.converted_model_dir(gguf, root)
    assert converted == [gguf] and (dest / "config.json").is_file()
    start, end = _store_lines(caplog)
    assert "converting the model toy.gguf once" in start and "(about 5 s;" in start
    assert str(dest) in start
    assert end.startswith("converted the model in ") and end.endswith(" s")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=store.__name__):
        assert store.converted_model_dir(gguf, root) == dest  # cached: silent
    assert _store_lines(caplog) == []
    assert converted == [gguf]


def test_a_failed_conversion_logs_no_end_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(gguf: Path, out: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(store, "_convert", broken)
    with caplog.at_level(logging.INFO, logger=store.__name__), pytest.raises(ModelError, match="disk full"):
        store.converted_model_dir(_gguf(tmp_path), tmp_path / "cache")
    [start] = _store_lines(caplog)
    assert "converting the model" in start
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-converted left


@pytest.mark.parametrize(("mib", "seconds"), [(1, 5.0), (94, 30.0), (400, 120.0)])
def test_the_estimate_follows_the_file_size(tmp_path: Path, mib: int, seconds: float) -> None:
    assert store.conversion_estimate_s(_gguf(tmp_path, mib)) == seconds


@pytest.mark.parametrize(("command", "log_level", "level"),
                         [("generate", None, logging.INFO), ("sweep", None, logging.INFO),
                          ("serve", None, logging.INFO), ("generate", "warning", logging.NOTSET),
                          ("serve", "debug", logging.NOTSET)])
def test_the_cli_shows_the_conversion_by_default(command: str, log_level: str | None,
                                                 level: int) -> None:
    assert store.__name__ in SHOWN_AT_INFO
    configure_logging(argparse.Namespace(log_level=log_level, _module=SUBCOMMANDS[command][0]))
    try:
        logger = logging.getLogger(store.__name__)
        assert logger.level == level
        if level == logging.INFO:
            assert logger.isEnabledFor(logging.INFO)
            # other INFO lines keep their subcommand's default (serve's: INFO)
            other = logging.getLogger("lynx_decode.decode_node").isEnabledFor(logging.INFO)
            assert other == (command == "serve")
    finally:
        for name in (*SHOWN_AT_INFO, "lynx_decode", "lynx_transport", "lynx_bench"):
            logging.getLogger(name).setLevel(logging.NOTSET)
