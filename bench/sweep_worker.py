"""The sweep's decode-node process: ``python -m lynx_bench.sweep_worker``.

Started by ``lynx sweep`` (inside the receiving namespace with ``--link netns``).
It loads the model once, then reads one JSON job per line on stdin and answers
each with one line ``RESULT {json}`` on stdout (other output may appear on
stdout too, e.g. from UCX, and is ignored by the driver). The first line it
prints is ``READY {json}`` with the model's facts, so the driver can validate
context lengths before any run starts.

A job: ``{"context", "prompt_id", "seed", "scheme", "planes", "bandwidth_gbps",
"new_tokens"}``: ``scheme`` is the codec's (``lynx`` for every LYNX split) and
``planes`` the LYNX split as a list of widths (null for other schemes). The
pass-key prompt of ``(context, prompt_id, seed)`` is built here with the model's
tokenizer (deterministic) and cached. A result holds the decode node's metrics,
``text``, ``tokens``, ``planes`` (as asked) and ``first_tentative_token``: the
first :class:`~lynx_decode.events.Tentative` token of the run (null when nothing
was drafted). A failed run answers ``RESULT {"error": "..."}``; the worker
carries on.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lynx_bench.node_args import (
    add_model_arguments,
    add_timeout_arguments,
    add_ucx_arguments,
    host_port,
    load_model,
    timeouts,
    transport_config,
)
from lynx_bench.workload import PassKeyCase, passkey_cases, score
from lynx_transport.errors import LynxError

__all__ = ["main"]


def _emit(tag: str, obj: dict[str, Any]) -> None:
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lynx-sweep-worker")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--prompts", type=int, required=True)
    add_timeout_arguments(parser, residual=True)
    add_ucx_arguments(parser)
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    server = host_port(args.connect, flag="--connect")
    model = load_model(args)
    from lynx_decode.codec.config import Scheme  # noqa: PLC0415
    from lynx_decode.decode_node import DecodeNode  # noqa: PLC0415
    from lynx_decode.events import Event, Tentative  # noqa: PLC0415

    info = model.info
    cases: dict[tuple[int, int], PassKeyCase] = {}
    with DecodeNode(model, host=args.listen_host, timeouts=timeouts(args),
                    config=transport_config(args)) as node:
        head_s = model.lm_head_s()
        _emit("READY", {"model_id": info.model_id, "max_positions": info.max_positions, "lm_head_s": head_s})
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            try:
                key = (int(job["context"]), int(job["seed"]))
                if key not in cases:
                    for i, case in enumerate(passkey_cases(model.tokenize, key[0], args.prompts,
                                                           key[1])):
                        cases[(key[0], key[1] + i)] = case
                case = cases[(key[0], key[1] + int(job["prompt_id"]))]
                planes = None if job.get("planes") is None else tuple(int(w) for w in job["planes"])
                first_tentative: list[int] = []

                def on_event(event: Event, seen: list[int] = first_tentative) -> None:
                    if isinstance(event, Tentative) and not seen:
                        seen.append(event.token)

                result = node.run(server, model.tokenize(case.prompt),
                                  scheme=Scheme(job["scheme"]),
                                  max_new_tokens=int(job["new_tokens"]),
                                  planes=planes,
                                  bandwidth_gbps=job["bandwidth_gbps"],
                                  on_event=on_event)
            except LynxError as exc:
                _emit("RESULT", {"error": f"{type(exc).__name__}: {exc}"})
                continue
            _emit("RESULT", {**result.metrics, "planes": None if planes is None else list(planes),
                             "physical_limit_s": physical_limit(result.metrics, job["bandwidth_gbps"],
                                                                head_s, info.num_layers),
                             "first_tentative_token": first_tentative[0] if first_tentative else None,
                             "text": result.text, "tokens": list(result.tokens),
                             "accuracy": score(result.text, case.key), "key": case.key,
                             "depth": case.depth, "prompt_tokens": case.n_tokens})
    return 0


def physical_limit(m: dict[str, Any], gbps: float | None, head_s: float, layers: int) -> float | None:
    """The first token's physical limit for this run: its anchor-lane bytes at the link
    rate, plus one layer and the LM head. A layer is this run's decode step on the exact
    cache (the decode node's ``step_s``) less the head, over the layers."""
    step = m.get("step_s")
    if gbps is None or step is None:
        return None
    return float(m["bytes_anchor"] * 8 / (gbps * 1e9) + max(0.0, step - head_s) / layers + head_s)


if __name__ == "__main__":
    sys.exit(main())
