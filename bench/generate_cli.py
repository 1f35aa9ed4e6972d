"""``lynx generate``: the decode node. Asks a prefill node for a prompt's KV cache,
decodes it (speculatively on the anchors for ``--scheme lynx``) and writes the
metrics, the text and the token ids to ``--json``. The LYNX split is
``--anchor-bits B`` (the split ``B,8-B``) or ``--planes 2,2,4`` (not both)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lynx_bench.node_args import (
    add_model_arguments,
    add_secret_argument,
    add_timeout_arguments,
    add_ucx_arguments,
    host_port,
    load_model,
    timeouts,
    transport_config,
)
from lynx_bench.sweep_config import lynx_scheme_name, parse_planes_flag
from lynx_decode.codec.config import ANCHOR_BITS, DEFAULT_ANCHOR_BITS, MAX_BITS, MIN_BITS
from lynx_decode.errors import PromptError
from lynx_transport.errors import ConfigError
from lynx_transport.seam import UCX, Transport

if TYPE_CHECKING:
    from lynx_decode.decode_node import DecodeNode
    from lynx_decode.model.protocol import CausalLM

__all__ = ["add_arguments", "decode_node", "run"]

SCHEMES = ("lynx", "int8", "int4", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, metavar="HOST:PORT",
                        help="the prefill node (`lynx serve` prints its address)")
    parser.add_argument("--prompt-file", required=True, type=Path, metavar="FILE",
                        help="UTF-8 prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the model's chat template")
    parser.add_argument("--scheme", choices=SCHEMES, default="lynx")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--anchor-bits", default=None, metavar="B|auto",
                       help=f"anchor bits for --scheme lynx: the split B,8-B ({MIN_BITS}..{MAX_BITS}, "
                            f"default {DEFAULT_ANCHOR_BITS}); auto: chosen for --bandwidth and the prompt "
                            "(possibly no split: then the run is INT8)")
    split.add_argument("--planes", default=None, metavar="W,W[,W...]|auto",
                       help="the LYNX split for --scheme lynx: plane widths from the top bit down, "
                            f"summing to 8, e.g. 2,2,4 (default {DEFAULT_ANCHOR_BITS},{8 - DEFAULT_ANCHOR_BITS}); "
                            "auto: as --anchor-bits auto")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    parser.add_argument("--max-draft", type=int, default=None, metavar="K",
                        help="most tokens drafted before verification (default: the engine's)")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GBPS",
                        help="ask the sender to shape this stream's link to GBPS Gbit/s")
    parser.add_argument("--check", action="store_true",
                        help="also decode on the plain INT8 cache and report equal_to_int8")
    parser.add_argument("--json", type=Path, required=True, metavar="OUT",
                        help="write metrics, text and tokens here")
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
    """The LYNX split ``--planes`` / ``--anchor-bits`` ask for, or ``"auto"``
    (:class:`ConfigError` if bad)."""
    if "auto" in (args.planes, args.anchor_bits):
        return "auto"
    if args.planes is not None:
        return parse_planes_flag([args.planes], "--planes")[0]
    if args.anchor_bits is None:
        return (DEFAULT_ANCHOR_BITS, 8 - DEFAULT_ANCHOR_BITS)
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
    if not args.json.parent.is_dir():
        raise ConfigError(f"--json: folder {args.json.parent} does not exist")
    return text


def decode_node(args: argparse.Namespace, model: CausalLM, transport: Transport = UCX) -> DecodeNode:
    """The decode node the flags describe (transport settings, every timeout)."""
    from lynx_decode.decode_node import DecodeNode  # noqa: PLC0415 - loads the decode stack

    return DecodeNode(model, host=args.listen_host, config=transport_config(args),
                      timeouts=timeouts(args), transport=transport)


def run(args: argparse.Namespace) -> int:
    server = host_port(args.connect, flag="--connect")
    text = _validate(args)
    transport_config(args)  # bad flags fail before the model loads
    timeouts(args)
    model = load_model(args)
    from lynx_decode.codec.config import Scheme  # noqa: PLC0415
    from lynx_decode.speculative import DEFAULT_MAX_DRAFT, MissingFull  # noqa: PLC0415

    ids = model.chat_prompt(text) if args.chat else model.tokenize(text)
    limit = model.info.max_positions
    if len(ids) + args.max_new_tokens > limit:
        raise PromptError(f"the prompt has {len(ids)} tokens; with {args.max_new_tokens} new tokens "
                          f"it exceeds the model's context window of {limit}")
    max_draft = DEFAULT_MAX_DRAFT if args.max_draft is None else args.max_draft
    with decode_node(args, model) as node:
        split = split_from_args(args)
        result = node.run(server, ids, scheme=Scheme(args.scheme), planes=split,
                          max_new_tokens=args.max_new_tokens, bandwidth_gbps=args.bandwidth,
                          max_draft=max_draft,
                          on_missing_residual=MissingFull(args.on_missing_residual))
        out = dict(result.metrics)  # its "planes": the split that ran (None: not LYNX)
        out.update(text=result.text, tokens=list(result.tokens))
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
    ttfct = "-" if out["ttfct_s"] is None else f"{out['ttfct_s']:.3f}"
    ran = out.get("planes")
    name = out["scheme"] if not ran else lynx_scheme_name(tuple(ran), (tuple(ran),))
    summary = (f"{name}: ttft_s={out['ttft_s']:.3f} ttfct_s={ttfct} "
               f"e2e_s={out['e2e_s']:.3f} tokens={len(result.tokens)}")
    if args.check:
        summary += f" equal_to_int8={out['equal_to_int8']}"
    print(summary)
    print(result.text)
    return 0 if out.get("equal_to_int8", True) or args.scheme != "lynx" else 1
