"""The sweep's decode-node process: ``python -m lynx_bench.sweep.worker``.

Started by ``lynx sweep`` (inside the receiving namespace with ``--link netns``).
It loads the model once, then reads one JSON job per line on stdin and answers
each with one line ``RESULT {json}`` on stdout (other output may appear on
stdout too, e.g. from UCX, and is ignored by the driver). The first line it
prints is ``READY {json}`` with the model's facts, so the driver can validate
context lengths before any run starts.

A job: ``{"context", "prompt_id", "seed", "scheme", "planes", "bandwidth_gbps",
"new_tokens", "workload"}``: ``scheme`` is the codec's (``lynx`` for every LYNX
split), ``planes`` the LYNX split as a list of widths (null for other schemes;
``"auto"``: the decode node chooses, and the result's ``planes`` say what) and
``workload`` a :class:`~lynx_bench.sweep.config.SweepWorkload` value (default
``passkey``). The prompt of ``(workload, context, prompt_id, seed)`` is built here
with the model's tokenizer (deterministic) and cached: a pass-key prompt, or the
first ``context`` tokens of the text window
``text_windows(corpus, context, TEXT_CONTINUATION, prompts, seed)[prompt_id]`` (the
windows ``lynx sweep --workload fidelity`` scores). A result holds the decode node's
metrics, ``text``, ``tokens``, ``planes`` (as asked), ``first_tentative_token``:
the first :class:`~lynx_decode.events.Tentative` token of the run (null when
nothing was drafted), and ``accuracy``: the pass key found (1.0/0.0), null for
the text workloads (the driver scores those). A failed run answers
``RESULT {"error": "..."}``; the worker carries on.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Literal

from lynx_bench.accuracy.texts import Corpus, load_corpus, text_windows
from lynx_bench.accuracy.workload import PassKeyCase, passkey_cases, score
from lynx_bench.common.node_args import (
    add_model_arguments,
    add_timeout_arguments,
    add_ucx_arguments,
    host_port,
    load_model,
    timeouts,
    transport_config,
)
from lynx_bench.sweep.config import TEXT_CONTINUATION, SweepWorkload
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
    windows: dict[tuple[int, int], list[int]] = {}
    corpus: list[Corpus] = []  # loaded on the first text job

    def text_prompt(context: int, seed: int, prompt_id: int) -> list[int]:
        if (context, seed) not in windows:
            if not corpus:
                corpus.append(load_corpus(model.tokenize))
            for i, w in enumerate(text_windows(corpus[0], context, TEXT_CONTINUATION, args.prompts, seed)):
                windows[(context, seed + i)] = list(w.ids[:context])
        return windows[(context, seed + prompt_id)]

    with DecodeNode(model, host=args.listen_host, timeouts=timeouts(args),
                    config=transport_config(args)) as node:
        head_s = model.lm_head_s()
        _emit("READY", {"model_id": info.model_id, "max_positions": info.max_positions, "lm_head_s": head_s})
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            try:
                workload = SweepWorkload(job.get("workload", SweepWorkload.PASSKEY.value))
                key = (int(job["context"]), int(job["seed"]))
                case: PassKeyCase | None = None
                if workload is SweepWorkload.PASSKEY:
                    if key not in cases:
                        for i, pk in enumerate(passkey_cases(model.tokenize, key[0], args.prompts, key[1])):
                            cases[(key[0], key[1] + i)] = pk
                    case = cases[(key[0], key[1] + int(job["prompt_id"]))]
                    prompt = model.tokenize(case.prompt)
                else:
                    prompt = text_prompt(key[0], key[1], int(job["prompt_id"]))
                asked = job.get("planes")
                planes: tuple[int, ...] | Literal["auto"] | None = (
                    None if asked is None else "auto" if asked == "auto" else tuple(int(w) for w in asked))
                first_tentative: list[int] = []

                def on_event(event: Event, seen: list[int] = first_tentative) -> None:
                    if isinstance(event, Tentative) and not seen:
                        seen.append(event.token)

                result = node.run(server, prompt,
                                  scheme=Scheme(job["scheme"]),
                                  max_new_tokens=int(job["new_tokens"]),
                                  planes=planes,
                                  bandwidth_gbps=job["bandwidth_gbps"],
                                  on_event=on_event)
            except LynxError as exc:
                _emit("RESULT", {"error": f"{type(exc).__name__}: {exc}"})
                continue
            chosen = result.metrics.get("planes") if planes == "auto" else planes
            _emit("RESULT", {**result.metrics, "planes": None if chosen is None else list(chosen),
                             "physical_limit_s": physical_limit(result.metrics, job["bandwidth_gbps"],
                                                                head_s, info.num_layers),
                             "first_tentative_token": first_tentative[0] if first_tentative else None,
                             "text": result.text, "tokens": list(result.tokens),
                             "accuracy": None if case is None else score(result.text, case.key),
                             "key": None if case is None else case.key,
                             "depth": None if case is None else case.depth, "prompt_tokens": len(prompt)})
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
