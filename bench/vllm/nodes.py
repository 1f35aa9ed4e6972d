"""One vLLM instance as a child process, driven by JSON lines: the building block of
``make vllm-demo`` and of the vLLM tests (run with the vLLM environment's Python).

    python -m lynx_bench.vllm.nodes --model DIR --connector lynx --role kv_producer --extra '{"port": 14600}'

It loads the model (offline, CPU, one thread unless ``--threads``), prints
``LYNX-NODE {"ready": true, ...}`` on stdout, then reads one command per line on
stdin and answers each with one ``LYNX-NODE {...}`` line (vLLM's own logs go to
stderr):

``{"op": "generate", "id": ..., "prompt_ids": [...], "max_tokens": N, "kv_transfer_params": {...}}``
    greedy decoding of a token-id prompt (EOS ignored, so N tokens come back);
    the answer has ``token_ids``, ``kv_transfer_params``, ``finish_reason``,
    ``started_at`` / ``first_token_at`` / ``finished_at`` (wall clock) and
    ``ttft_s`` (from the request's submission to its first output token: the
    consumer's clock, queueing and any KV load included) and ``e2e_s``.
``{"op": "batch", "requests": [{"id", "prompt_ids", "max_tokens", "kv_transfer_params", "after"}, ...], ...}``
    several greedy requests in the engine at once: each is submitted at once, or
    (``"after": [id, n]``) once request ``id`` has ``n`` tokens; once request ``"stop_after"``
    finished, every other one still running is aborted after ``"then_tokens"``
    more tokens. The answer has ``results`` by request id, each as ``generate``
    answers plus ``token_times`` (the wall clock at which each token came) and
    ``aborted``.
``{"op": "quit"}``
    shuts the engine down and exits.

vLLM's engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the
environment sets it), where ``vllm serve`` runs it in a child process: the connector's
scheduler and worker sides are the same either way, and a node imports vLLM once, not twice,
so it starts in half the time.

``--connector``: ``lynx`` (:class:`lynx_vllm.connector.LynxConnector`), ``example``
(vLLM's ``ExampleConnector``, through a shared folder ``--storage``) or ``none``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

__all__ = ["main"]

PREFIX = "LYNX-NODE "


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _engine(args: argparse.Namespace) -> Any:
    from vllm import LLM  # noqa: PLC0415 - the vLLM environment only
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    transfer = None
    if args.connector == "lynx":
        transfer = KVTransferConfig(kv_connector="LynxConnector", kv_connector_module_path="lynx_vllm.connector",
                                    kv_role=args.role, kv_connector_extra_config=json.loads(args.extra),
                                    kv_load_failure_policy=args.policy)
    elif args.connector == "example":
        transfer = KVTransferConfig(kv_connector="ExampleConnector", kv_role=args.role,
                                    kv_connector_extra_config={"shared_storage_path": args.storage})
    return LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
               enable_prefix_caching=False, enforce_eager=True, kv_transfer_config=transfer, seed=0)


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    extra = {"kv_transfer_params": cmd["kv_transfer_params"]} if cmd.get("kv_transfer_params") else None
    params = SamplingParams(max_tokens=int(cmd["max_tokens"]), temperature=0.0, ignore_eos=True, extra_args=extra)
    engine = llm.llm_engine
    rid = str(cmd["id"])
    started = time.time()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=list(cmd["prompt_ids"])), params)
    first: float | None = None
    final = None
    deadline = time.monotonic() + float(cmd.get("timeout_s", 300))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.time()
            if out.finished:
                final = out
        if time.monotonic() > deadline:
            engine.abort_request([rid])
            return {"id": rid, "error": f"no answer within {cmd.get('timeout_s', 300)} s"}
    finished = time.time()
    if final is None:
        return {"id": rid, "error": "the request finished without an output"}
    completion = final.outputs[0]
    return {"id": rid, "token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason,
            "kv_transfer_params": final.kv_transfer_params, "started_at": started, "first_token_at": first,
            "finished_at": finished, "ttft_s": None if first is None else first - started,
            "e2e_s": finished - started, "error": None}


def _batch(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    engine = llm.llm_engine
    state: dict[str, dict[str, Any]] = {}
    waiting = [r for r in cmd["requests"] if r.get("after")]

    def submit(r: dict[str, Any]) -> None:
        extra = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
        params = SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True, extra_args=extra)
        state[str(r["id"])] = {"started_at": time.time(), "token_ids": [], "token_times": [], "final": None,
                               "finished_at": None, "aborted": False}
        engine.add_request(str(r["id"]), TokensPrompt(prompt_token_ids=list(r["prompt_ids"])), params)

    for r in cmd["requests"]:
        if not r.get("after"):
            submit(r)
    stop_after, then = cmd.get("stop_after"), int(cmd.get("then_tokens", 0))
    marks: dict[str, int] | None = None
    timeout_s = float(cmd.get("timeout_s", 300))
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() or waiting:
        for out in engine.step():
            s = state.get(out.request_id)
            if s is None:
                continue
            now = time.time()
            ids = list(out.outputs[0].token_ids) if out.outputs else []
            s["token_times"].extend([now] * (len(ids) - len(s["token_ids"])))
            s["token_ids"] = ids
            if out.finished:
                s["final"], s["finished_at"] = out, now
        for r in list(waiting):
            dep, n = r["after"]
            if dep in state and (len(state[dep]["token_ids"]) >= int(n) or state[dep]["finished_at"] is not None):
                submit(r)
                waiting.remove(r)
        if stop_after in state and state[stop_after]["finished_at"] is not None:
            if marks is None:
                marks = {rid: len(s["token_ids"]) for rid, s in state.items() if s["finished_at"] is None}
            due = [rid for rid, m in marks.items()
                   if state[rid]["finished_at"] is None and len(state[rid]["token_ids"]) >= m + then]
            if due:
                engine.abort_request(due)
                for rid in due:
                    state[rid]["aborted"], state[rid]["finished_at"] = True, time.time()
        if time.monotonic() > deadline:
            engine.abort_request([rid for rid, s in state.items() if s["finished_at"] is None])
            return {"id": cmd.get("id"), "error": f"the batch did not finish within {timeout_s:g} s"}
    results = {}
    for rid, s in state.items():
        final = s["final"]
        times = s["token_times"]
        results[rid] = {"id": rid, "token_ids": s["token_ids"], "token_times": times, "aborted": s["aborted"],
                        "finish_reason": "abort" if final is None else final.outputs[0].finish_reason,
                        "kv_transfer_params": None if final is None else final.kv_transfer_params,
                        "started_at": s["started_at"], "first_token_at": times[0] if times else None,
                        "finished_at": s["finished_at"], "error": None}
    return {"id": cmd.get("id"), "results": results, "error": None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lynx_bench.vllm.nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--connector", choices=("lynx", "example", "none"), default="lynx")
    p.add_argument("--role", choices=("kv_producer", "kv_consumer", "kv_both"), default="kv_consumer")
    p.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON (lynx)")
    p.add_argument("--policy", choices=("fail", "recompute"), default="fail", help="kv_load_failure_policy")
    p.add_argument("--storage", default="/tmp/lynx-example-connector", help="the example connector's folder")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else "auto")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # the engine core in this process (see the module docstring)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    started = time.monotonic()
    llm = _engine(args)
    _say({"ready": True, "load_s": time.monotonic() - started, "pid": os.getpid()})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        try:
            _say(_batch(llm, cmd) if cmd.get("op") == "batch" else _generate(llm, cmd))
        except Exception as exc:  # noqa: BLE001 - the driver hears every failure as an answer
            _say({"id": cmd.get("id"), "error": f"{type(exc).__name__}: {exc}"})
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
