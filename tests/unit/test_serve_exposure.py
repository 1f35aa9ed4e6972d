"""``lynx serve`` beyond loopback without a shared secret logs one warning at startup
(before the model loads); on loopback, or with a secret, it logs none."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from lynx_bench.cli import _parser
from lynx_bench.common.node_args import SECRET_ENV, transport_config
from lynx_bench.nodes import serve


class Stop(Exception):
    """Raised instead of loading the model: the startup checks are over."""


def _startup_warnings(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                      *flags: str) -> list[str]:
    """The WARNING records ``lynx serve FLAGS`` logs before it loads its model."""
    def stop(args: Any) -> None:
        raise Stop

    monkeypatch.setattr(serve, "load_model", stop)
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(Stop):
        serve.run(_parser().parse_args(["serve", *flags]))
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.mark.parametrize("listen", ["0.0.0.0:7000", "[::]:7000", "192.0.2.7:0"])
def test_serve_beyond_loopback_without_a_secret_warns_once(
        listen: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    [warning] = _startup_warnings(monkeypatch, caplog, "--listen", listen)
    assert "no shared secret is set" in warning
    assert "anyone who can reach that port" in warning
    assert not warning.startswith("listening on")  # stdout's readiness line, parsed by scripts
    assert "--secret-file" in warning and f"${SECRET_ENV}" in warning
    assert "\n" not in warning


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.2:7000", "[::1]:7000", "localhost:7000",
                                    "::ffff:127.0.0.1:7000", ":7000"])
def test_serve_on_loopback_does_not_warn(listen: str, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    assert _startup_warnings(monkeypatch, caplog, "--listen", listen) == []


def test_the_default_listen_address_does_not_warn(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    assert _startup_warnings(monkeypatch, caplog) == []


def test_a_secret_file_or_the_env_variable_silences_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "lynx.secret"
    secret.write_text("s" * 32 + "\n")
    assert _startup_warnings(monkeypatch, caplog, "--listen", "0.0.0.0:7000",
                             "--secret-file", str(secret)) == []
    monkeypatch.setenv(SECRET_ENV, "e" * 32)
    assert _startup_warnings(monkeypatch, caplog, "--listen", "0.0.0.0:7000") == []


def test_the_decision_from_the_parsed_flags() -> None:
    args = _parser().parse_args(["serve", "--listen", "0.0.0.0:7000"])
    assert serve.exposure_warning(args.listen, transport_config(args).secret) is not None
    assert serve.exposure_warning(args.listen, b"x" * 16) is None
    assert serve.exposure_warning("127.0.0.1:7000", None) is None
    assert not serve.is_loopback("no-such-host.invalid")
    assert not serve.is_loopback("0.0.0.0")
