"""``lynx load --decode model``'s decode node: ``python -m lynx_bench.load.decode``.

A real decode node (:class:`lynx_decode.decode_node.DecodeNode` with the model,
:func:`lynx_bench.common.node_args.load_model`) driven like the sink
(:mod:`lynx_bench.load.sink`): ``READY {json}`` once the model is loaded, then
``{"jobs": [...]}`` lines on stdin, each job started in a thread of its own at
its ``send_unix`` (open-loop: whatever happened to the earlier ones), and one
``RESULT {json}`` line per job with the run's times counted from its request
(``DecodeNode.run``'s ``*_from_request_s`` metrics: queueing and prefill at the
prefill node included): ``ttft_s``, ``ttfct_s``, ``e2e_s``,
``time_to_anchor_s``, ``time_to_full_s``, plus ``sent_unix``, the bytes, and
``scheme`` / ``planes`` / ``split_choice``: what ran (``planes`` None unless LYNX;
a job's ``planes`` ``auto`` lets the node choose per request,
``DecodeNode.run(planes="auto")``, possibly no split: then ``scheme`` is ``int8``).

A job still running ``timeout_s`` after it started is answered ``timeout`` at
once; its thread ends within the node's own timeouts and its late result is
dropped. EOF on stdin ends the process.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import json
import logging
import sys
import threading
import time
from typing import Any

from lynx_bench.common.node_args import (
    add_model_arguments,
    add_timeout_arguments,
    add_ucx_arguments,
    host_port,
    load_model,
    timeouts,
)
from lynx_bench.load.logic import job_split, prompt_set
from lynx_bench.load.results import Status
from lynx_bench.load.sink import Emitter, transport_config
from lynx_transport.errors import LynxError

__all__ = ["check_available", "main"]

log = logging.getLogger("lynx_bench.load.decode")


def check_available() -> None:
    """``ModuleNotFoundError`` (the CLI prints the install hint) when the model extra is missing."""
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _result(job: dict[str, Any], sent: float, metrics: dict[str, Any]) -> dict[str, Any]:
    queue_s = metrics.get("queue_s")

    def from_request(key: str) -> float | None:
        value = metrics.get(key)
        return None if value is None or queue_s is None else float(value) + float(queue_s)

    residual = bool(metrics.get("bytes_residual"))
    return {"request_id": job["request_id"], "status": Status.COMPLETED.value, "sent_unix": sent,
            "scheduled_unix": job["send_unix"],
            "ttft_s": metrics.get("ttft_from_request_s"), "ttfct_s": metrics.get("ttfct_from_request_s"),
            "e2e_s": metrics.get("e2e_from_request_s"),
            "time_to_anchor_s": from_request("transfer_anchor_s"),
            "time_to_full_s": from_request("transfer_residual_s" if residual else "transfer_anchor_s"),
            "bytes_anchor": metrics.get("bytes_anchor"), "bytes_residual": metrics.get("bytes_residual"),
            "scheme": metrics.get("scheme", job["scheme"]), "planes": metrics.get("planes"),
            "split_choice": metrics.get("split_choice"),
            "queue_s": queue_s, "acceptance_rate": metrics.get("acceptance_rate"), "error": None}


class _Worker:
    """Starts each job's run at its time; answers each job exactly once."""

    def __init__(self, node: Any, server: tuple[str, int], prompts: list[list[int]], emit: Emitter) -> None:
        self._node = node
        self._server = server
        self._prompts = prompts
        self._emit = emit
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, dict[str, Any]]] = []
        self._deadlines: list[tuple[float, int, str]] = []
        self._answered: set[str] = set()
        self._sent: dict[str, float] = {}
        self._seq = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="load-decode", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[dict[str, Any]]) -> None:
        with self._lock:
            for job in jobs:
                self._seq += 1
                heapq.heappush(self._heap, (float(job["send_unix"]), self._seq, job))
            self._lock.notify()

    def _answer(self, rid: str, result: dict[str, Any]) -> None:
        with self._lock:
            if rid in self._answered:
                return
            self._answered.add(rid)
        self._emit("RESULT", result)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop:
                    now = time.time()
                    nxt = [t for t in (self._heap[0][0] if self._heap else None,
                                       self._deadlines[0][0] if self._deadlines else None) if t is not None]
                    if nxt and min(nxt) <= now:
                        break
                    self._lock.wait(min(nxt) - now if nxt else None)
                if self._stop:
                    return
                now = time.time()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                expired = []
                while self._deadlines and self._deadlines[0][0] <= now:
                    expired.append(heapq.heappop(self._deadlines)[2])
                for job in due:
                    self._seq += 1
                    heapq.heappush(self._deadlines, (now + float(job["timeout_s"]), self._seq,
                                                     str(job["request_id"])))
            for job in due:
                threading.Thread(target=self._run, args=(job,), name=f"load-run-{job['request_id']}",
                                 daemon=True).start()
            for rid in expired:
                self._answer(rid, {"request_id": rid, "status": Status.TIMEOUT.value,
                                   "sent_unix": self._sent.get(rid), "error": "not finished in time"})

    def _run(self, job: dict[str, Any]) -> None:
        from lynx_decode.errors import ServerBusyError  # noqa: PLC0415 - loaded with the model

        rid = str(job["request_id"])
        sent = self._sent[rid] = time.time()
        scheme, planes = job_split(job)  # planes "auto": the node chooses for the link and the prompt
        try:
            result = self._node.run(self._server, self._prompts[int(job["prompt_id"])],
                                    scheme=scheme, max_new_tokens=int(job["new_tokens"]),
                                    planes=planes, bandwidth_gbps=job["bandwidth_gbps"])
        except ServerBusyError as exc:
            self._answer(rid, {"request_id": rid, "status": Status.BUSY.value, "sent_unix": sent,
                               "scheduled_unix": job["send_unix"], "error": str(exc)})
        except LynxError as exc:
            self._answer(rid, {"request_id": rid, "status": Status.FAILED.value, "sent_unix": sent,
                               "scheduled_unix": job["send_unix"], "error": f"{type(exc).__name__}: {exc}"})
        else:
            self._answer(rid, _result(job, sent, result.metrics))

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(5.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lynx-load-decode")
    parser.add_argument("--connect", required=True, metavar="HOST:PORT", help="the prefill node")
    parser.add_argument("--listen-host", default="127.0.0.1", help="address replies come to")
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--pool-bytes", type=int, required=True)
    parser.add_argument("--pool-wait", type=float, required=True, metavar="S")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_ucx_arguments(parser)
    add_timeout_arguments(parser, residual=True)
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    server = host_port(args.connect, flag="--connect")
    model = load_model(args)
    from lynx_decode.decode_node import DecodeNode  # noqa: PLC0415 - loads the decode stack

    emit = Emitter()
    prompts = prompt_set(args.seed, args.prompts, args.context, args.vocab)
    with DecodeNode(model, host=args.listen_host, pool_bytes=args.pool_bytes, timeouts=timeouts(args),
                    config=transport_config(args, args.pool_wait)) as node:
        node.prepare(args.context, max_new_tokens=args.new_tokens)
        worker = _Worker(node, server, prompts, emit)
        emit("READY", {"address": list(node.address), "model_id": model.info.model_id})
        try:
            for line in sys.stdin:
                if line.strip():
                    worker.submit(json.loads(line)["jobs"])
        finally:
            worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
