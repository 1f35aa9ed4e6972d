"""``lynx generate``: the decode node. Asks a prefill node for a prompt's KV cache,
decodes it (speculatively on the anchors for ``--scheme lynx``) and writes the
metrics, the text, the token ids and the token events (``token_events``, seconds
from t0) to ``--json``. The LYNX split is ``--anchor-bits B`` (the split ``B,8-B``)
or ``--planes 2,2,4`` (not both); by default ``auto``, chosen for the link and the
prompt (:mod:`lynx_decode.split_choice`), possibly none (then the run is INT8).

``--stream`` prints the tokens as they come (:mod:`lynx_bench.nodes.token_stream`);
``--timeline`` draws the run (:mod:`lynx_bench.nodes.timeline`). Before the model loads
(seconds), the prefill node's address is probed with a TCP connect to its control
port, the transport's own first step, so a wrong ``--connect`` fails at once."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from lynx_bench.common.node_args import (
    add_model_arguments,
    add_secret_argument,
    add_timeout_arguments,
    add_ucx_arguments,
    check_model_arg,
    early_prompt_tokens,
    host_port,
    load_model,
    timeouts,
    transport_config,
)
from lynx_bench.nodes.timeline import FORMATS as TIMELINE_FORMATS
from lynx_bench.nodes.timeline import token_events
from lynx_bench.nodes.token_stream import TokenStream
from lynx_bench.sweep.config import lynx_scheme_name, parse_planes_flag
from lynx_decode.codec.config import ANCHOR_BITS, DEFAULT_ANCHOR_BITS, MAX_BITS, MIN_BITS
from lynx_decode.errors import PromptError
from lynx_transport import UCX
from lynx_transport.errors import ConfigError, ConnectError
from lynx_transport.seam import Transport

if TYPE_CHECKING:
    from lynx_decode.decode_node import DecodeNode
    from lynx_decode.events import Event
    from lynx_decode.model.protocol import CausalLM

__all__ = ["add_arguments", "decode_node", "run", "probe", "summary_line"]

SCHEMES = ("lynx", "int8", "int4", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, metavar="HOST:PORT",
                        help="the prefill node (`lynx serve` prints its address); probed with a TCP "
                             "connect before the model loads, so a wrong address fails at once")
    parser.add_argument("--prompt-file", required=True, type=Path, metavar="FILE",
                        help="UTF-8 prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the model's chat template")
    parser.add_argument("--scheme", choices=SCHEMES, default="lynx")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--anchor-bits", default=None, metavar="B|auto",
                       help=f"anchor bits for --scheme lynx: the split B,8-B ({MIN_BITS}..{MAX_BITS}); "
                            "auto (the default): chosen for the link (--bandwidth, else the rate seen on "
                            "earlier streams) and the prompt, possibly no split: then the run is INT8; with "
                            f"nothing known about the link, {DEFAULT_ANCHOR_BITS},{8 - DEFAULT_ANCHOR_BITS}")
    split.add_argument("--planes", default=None, metavar="W,W[,W...]|auto",
                       help="the LYNX split for --scheme lynx: plane widths from the top bit down, "
                            "summing to 8, e.g. 2,2,4; auto (the default): as --anchor-bits auto")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    parser.add_argument("--max-draft", type=int, default=None, metavar="K",
                        help="most tokens drafted before verification (default: the engine's)")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GBPS",
                        help="ask the sender to shape this stream's link to GBPS Gbit/s")
    parser.add_argument("--check", action="store_true",
                        help="also decode on the plain INT8 cache and report equal_to_int8")
    parser.add_argument("--json", type=Path, required=True, metavar="OUT",
                        help="write metrics, text, tokens and token_events here")
    parser.add_argument("--stream", action="store_true",
                        help="print the tokens as they come, then one line of ttft_s, ttfct_s, "
                             "acceptance; on a terminal tentative tokens are dim and withdrawn ones "
                             "erased as they are rolled back; to a pipe or file only committed text, "
                             "no escape codes")
    parser.add_argument("--timeline", type=Path, default=None, metavar="FILE",
                        help="draw the run on one time axis (seconds from t0): bytes landed per lane, "
                             "the first step, drafting, the verify pass and every token event "
                             f"({', '.join(s[1:] for s in TIMELINE_FORMATS)})")
    parser.add_argument("--listen-host", default="127.0.0.1", metavar="HOST",
                        help="address the prefill node connects back to (default 127.0.0.1)")
    parser.add_argument("--on-missing-residual", choices=["fail", "unverified"], default="fail",
                        help="when the residual never arrives (prefill node lost, or "
                             "--residual-timeout passed): fail (default), or finish on the "
                             "anchors with every token marked unverified")
    add_secret_argument(parser)
    add_timeout_arguments(parser, residual=True)
    add_ucx_arguments(parser)
    add_model_arguments(parser)


def split_from_args(args: argparse.Namespace) -> tuple[int, ...] | Literal["auto"]:
    """The LYNX split ``--planes`` / ``--anchor-bits`` ask for, or ``"auto"`` (also
    when neither is given; :class:`ConfigError` if bad)."""
    if "auto" in (args.planes, args.anchor_bits):
        return "auto"
    if args.planes is not None:
        return parse_planes_flag([args.planes], "--planes")[0]
    if args.anchor_bits is None:
        return "auto"
    try:
        bits = int(args.anchor_bits)
    except ValueError:
        raise ConfigError(f"--anchor-bits: expected an integer or auto, got {args.anchor_bits!r}") from None
    if bits not in ANCHOR_BITS:
        raise ConfigError(f"--anchor-bits: must be in {MIN_BITS}..{MAX_BITS} or auto, got {bits}")
    return (bits, 8 - bits)


def _validate(args: argparse.Namespace) -> str:
    if args.bandwidth is not None and not (args.bandwidth > 0 and math.isfinite(args.bandwidth)):
        raise ConfigError(f"--bandwidth: {args.bandwidth} is not a positive number of Gbit/s")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.max_draft is not None and args.max_draft < 0:
        raise ConfigError(f"--max-draft: must be >= 0, got {args.max_draft}")
    split_from_args(args)
    try:
        text = args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompt-file: cannot read {args.prompt_file}: {exc}") from None
    if not text.strip():
        raise PromptError(f"--prompt-file: the prompt is empty ({args.prompt_file})")
    if not args.json.parent.is_dir():
        raise ConfigError(f"--json: folder {args.json.parent} does not exist")
    if args.timeline is not None:
        if args.timeline.suffix.lower() not in TIMELINE_FORMATS:
            raise ConfigError(f"--timeline: {args.timeline} must end in one of {', '.join(TIMELINE_FORMATS)}")
        if not args.timeline.parent.is_dir():
            raise ConfigError(f"--timeline: folder {args.timeline.parent} does not exist")
    return text


def _too_short(tokens: int) -> PromptError:
    return PromptError(f"--prompt-file: the prompt is {tokens} token{'s' * (tokens != 1)} long; "
                       "it needs at least 2 (the prefill node caches all but the last, which the "
                       "decode node runs itself)")


def probe(server: tuple[str, int], timeout: float) -> None:
    """Fail now if nobody listens at ``server``: a TCP connect to the prefill node's
    control port (where ``Transport.connect`` starts too), closed at once, before the
    handshake (the node drops it without a word). :class:`ConnectError` names the address."""
    try:
        socket.create_connection(server, timeout=timeout).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ConnectError(f"--connect {server[0]}:{server[1]}: no prefill node there ({reason}); "
                           "start one with `lynx serve --listen HOST:PORT`") from None


def decode_node(args: argparse.Namespace, model: CausalLM, transport: Transport = UCX) -> DecodeNode:
    """The decode node the flags describe (transport settings, every timeout)."""
    from lynx_decode.decode_node import DecodeNode  # noqa: PLC0415 - loads the decode stack

    return DecodeNode(model, host=args.listen_host, config=transport_config(args),
                      timeouts=timeouts(args), transport=transport)


def run(args: argparse.Namespace) -> int:
    server = host_port(args.connect, flag="--connect")
    text = _validate(args)
    check_model_arg(args)
    transport_config(args)  # bad flags fail before the model loads
    waits = timeouts(args)
    probe(server, waits.connect_s)  # ... and so does a prefill node that is not there
    if not args.chat and (count := early_prompt_tokens(args, text)) is not None and count < 2:
        raise _too_short(count)  # ... and a prompt too short, where its tokenizer tells without the model
    model = load_model(args)
    from lynx_decode.codec.config import Scheme  # noqa: PLC0415
    from lynx_decode.decode_config import DEFAULT_MAX_DRAFT, MissingFull  # noqa: PLC0415

    ids = model.chat_prompt(text) if args.chat else model.tokenize(text)
    if len(ids) < 2:
        raise _too_short(len(ids))
    limit = model.info.max_positions
    if len(ids) + args.max_new_tokens > limit:
        raise PromptError(f"the prompt has {len(ids)} tokens; with {args.max_new_tokens} new tokens "
                          f"it exceeds the model's context window of {limit}")
    max_draft = DEFAULT_MAX_DRAFT if args.max_draft is None else args.max_draft
    stdout = sys.stdout
    tty = _is_terminal(stdout)
    renderer = TokenStream(model.detokenize, tty=tty, width=shutil.get_terminal_size().columns) \
        if args.stream else None
    timed: list[tuple[float, Event]] = []

    def on_event(event: Event) -> None:
        timed.append((time.time(), event))
        if renderer is not None:
            shown = renderer.feed(event)
            if shown:
                stdout.write(shown)
                stdout.flush()

    with decode_node(args, model) as node:
        split = split_from_args(args)
        try:
            result = node.run(server, ids, scheme=Scheme(args.scheme), planes=split,
                              max_new_tokens=args.max_new_tokens, bandwidth_gbps=args.bandwidth,
                              max_draft=max_draft,
                              on_missing_residual=MissingFull(args.on_missing_residual), on_event=on_event)
        except BaseException:
            if renderer is not None:  # tentative tokens of a failed run are void: off the screen
                stdout.write(renderer.abort())
                stdout.flush()
            raise
        out = dict(result.metrics)  # its "planes": the split that ran (None: not LYNX)
        out.update(text=result.text, tokens=list(result.tokens),
                   token_events=token_events(timed, out["t0_unix"]))
        if out.get("split_choice"):
            print(f"lynx: --anchor-bits auto chose {out['split_choice']}", file=sys.stderr)
        if args.check:
            ref = node.run(server, ids, scheme=Scheme.INT8, max_new_tokens=args.max_new_tokens)
            out["equal_to_int8"] = list(ref.tokens) == list(result.tokens)
            out["int8_tokens"] = list(ref.tokens)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    if not out["verified"]:
        print(f"lynx: warning: the residual never arrived ({out['unverified_reason']}); these "
              f"{len(result.tokens)} tokens were decoded on the anchors only and are UNVERIFIED",
              file=sys.stderr)
    ran = out.get("planes")
    name = out["scheme"] if not ran else lynx_scheme_name(tuple(ran), (tuple(ran),))
    if args.timeline is not None:
        from lynx_bench.nodes.timeline import write_timeline  # noqa: PLC0415 - loads matplotlib

        write_timeline(args.timeline, out, title=_title(name, out, args.bandwidth))
    print(summary_line(name, out, check=args.check))  # with --stream: the closing line
    if renderer is None:
        print(result.text)
    return 0 if out.get("equal_to_int8", True) or args.scheme != "lynx" else 1


def summary_line(name: str, out: dict[str, Any], *, check: bool) -> str:
    """The one line of clocks after a run (``out``: the ``--json`` dict): ttft_s,
    ttfct_s, e2e_s, acceptance (accepted/drafted), tokens, equal_to_int8 with ``check``."""
    ttfct = "-" if out["ttfct_s"] is None else f"{out['ttfct_s']:.3f}"
    rate = out.get("acceptance_rate")
    acceptance = "-" if rate is None else f"{rate:.2f} ({out['accepted']}/{out['drafted']})"
    line = (f"{name}: ttft_s={out['ttft_s']:.3f} ttfct_s={ttfct} "
            f"e2e_s={out['e2e_s']:.3f} acceptance={acceptance} tokens={len(out['tokens'])}")
    if check:
        line += f" equal_to_int8={out['equal_to_int8']}"
    return line


def _title(name: str, out: dict[str, Any], gbps: float | None) -> str:
    link = "unshaped link" if gbps is None else f"{gbps:g} Gbit/s"
    return f"{name}: {out['prompt_tokens']} prompt tokens, {link}"


def _is_terminal(stream: TextIO) -> bool:
    """``stream`` is a terminal that takes cursor escapes (not ``TERM=dumb``)."""
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):  # pytest's capture, a closed or fd-less stream
        return False
