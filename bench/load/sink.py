"""``lynx load``'s sink decode node: ``python -m lynx_bench.load.sink``.

A decode node that receives KV streams into its pool and records when each
request's anchors (the ANCHOR lane) and its whole cache have landed, without
running the model, so ``lynx load --decode sink`` measures the transport at
load on a small machine.

Started by :mod:`lynx_bench.load.cli`, one process per decode node. It listens
(``lynx_transport.seam.UCX.listen``) for the prefill node's replies, connects
once to the prefill node to send its requests, prints ``READY {json}``, then
reads its schedule from stdin: JSON lines ``{"jobs": [{"request_id", "scheme",
"prompt_id", "send_unix", "timeout_s", "planes", "bandwidth_gbps", "hold_residual"},
...]}``, ``send_unix`` an absolute wall-clock time (``time.time()``; the nodes share
the host), so arrivals are open-loop: a request is sent at its time whatever
happened to the earlier ones. ``planes``: the LYNX split, or None: a LYNX job then
asks for INT8 (``--planes auto`` chose no split; :func:`lynx_bench.load.logic.job_split`),
never ``auto`` (the sink runs no model; ``lynx load`` chose). It answers one
``RESULT {json}`` line per job (:func:`lynx_bench.load.results.request_row` reads it):
``request_id``, ``status`` (:class:`~lynx_bench.load.results.Status`), ``scheme`` and
``planes`` (what it asked for; ``planes`` None unless LYNX), ``sent_unix``,
``scheduled_unix``, ``anchor_unix``, ``full_unix``, ``bytes_anchor``,
``bytes_residual``, ``error``.
EOF on stdin ends it (streams still open are failed by closing the listener).

Threads: the main thread reads stdin; one scheduler thread (``load-sink``)
sends each request at its time, polls the request streams' confirmations
and ends requests past their deadline (``timeout``: an open stream is
abandoned, so the prefill node stops sending it); the listener's callback
thread records the KV streams' events. State is shared under one lock;
``RESULT`` lines are written under another.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from lynx_bench.common.node_args import add_timeout_arguments, add_ucx_arguments, host_port, timeouts, ucx_settings
from lynx_bench.load.logic import job_split, prompt_set
from lynx_bench.load.results import Status
from lynx_decode.codec.config import Scheme
from lynx_decode.kvheader import KVHeader
from lynx_decode.request import KVRequest, parse_error_reply
from lynx_decode.timeouts import Timeouts
from lynx_transport import UCX, Lane, ReceivePool, ReceiveStream, SendStream, TransportConfig
from lynx_transport.errors import LynxError, TransportError
from lynx_transport.seam import Listener, ReceiverCallbacks, Sender

__all__ = ["Sink", "Emitter", "add_ucx_arguments", "transport_config", "main"]

log = logging.getLogger("lynx_bench.load.sink")

#: How often the scheduler looks at request streams still waiting for their confirmation.
POLL_S = 0.05


class Emitter:
    """Writes ``TAG {json}`` lines to a text stream, one writer at a time."""

    def __init__(self, out: Any = None) -> None:
        self._out = out if out is not None else sys.stdout
        self._lock = threading.Lock()

    def __call__(self, tag: str, obj: dict[str, Any]) -> None:
        line = f"{tag} {json.dumps(obj)}\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()


@dataclasses.dataclass(eq=False)
class _Request:
    job: dict[str, Any]
    request_id: str
    scheduled_unix: float
    scheme: Scheme
    planes: tuple[int, ...]
    sent_unix: float | None = None
    request_stream: SendStream | None = None
    stream: ReceiveStream | None = None
    anchor_unix: float | None = None
    full_unix: float | None = None
    bytes_anchor: int | None = None
    bytes_residual: int | None = None
    done: bool = False

    def result(self, status: Status, error: str | None) -> dict[str, Any]:
        return {"request_id": self.request_id, "status": status.value, "scheme": self.scheme.value,
                "planes": list(self.planes) if self.scheme is Scheme.LYNX else None,
                "sent_unix": self.sent_unix,
                "scheduled_unix": self.scheduled_unix, "anchor_unix": self.anchor_unix,
                "full_unix": self.full_unix, "bytes_anchor": self.bytes_anchor,
                "bytes_residual": self.bytes_residual, "error": error}


class Sink:
    """Sends scheduled requests to ``server`` and records their KV streams' landing.

    ``prompts``: the token ids of each prompt id. ``emit(tag, obj)``: where the
    ``RESULT`` of each job goes. ``pool_bytes``: the receive pool (it should hold
    a few streams; past that a stream waits ``config.pool_wait_s`` for space).
    """

    def __init__(self, server: tuple[str, int], prompts: list[list[int]], *, emit: Emitter,
                 listen_host: str = "127.0.0.1", pool_bytes: int, timeouts: Timeouts,
                 config: TransportConfig) -> None:
        self._server = server
        self._prompts = [np.asarray(p, dtype="<i4").view(np.uint8) for p in prompts]
        self._emit = emit
        self._timeouts = timeouts
        self._config = timeouts.transport(config)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._requests: dict[str, _Request] = {}
        self._by_stream: dict[int, _Request] = {}
        self._release_on_complete: set[int] = set()
        self._sends: list[tuple[float, int, str]] = []      # (send_unix, seq, request_id)
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, seq, request_id)
        self._unconfirmed: list[_Request] = []
        self._seq = 0
        self._stopping = False
        self._listener: Listener = UCX.listen(
            ReceivePool(pool_bytes), host=listen_host, config=self._config,
            callbacks=ReceiverCallbacks(on_stream_open=self._on_open, on_lane_complete=self._on_lane,
                                        on_stream_complete=self._on_complete,
                                        on_stream_failed=self._on_failed))
        self._conn: Sender | None = None
        try:
            self._conn = self._connect()
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._schedule_loop, name="load-sink", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def _connect(self) -> Sender:
        return UCX.connect(self._server, timeout=self._timeouts.connect_s, config=self._config)

    # -- jobs ------------------------------------------------------------------------------------
    def submit(self, jobs: list[dict[str, Any]]) -> None:
        """Schedule ``jobs`` (see the module docstring); each is answered by one RESULT.
        ``ValueError`` for a request id scheduled twice or a job whose split is ``auto``."""
        with self._wake:
            for job in jobs:
                rid = str(job["request_id"])
                if rid in self._requests:
                    raise ValueError(f"request id {rid!r} was scheduled twice")
                scheme, planes = job_split(job)
                if planes == "auto":
                    raise ValueError(f"request {rid!r}: a sink cannot choose a split (planes auto)")
                req = _Request(job, rid, float(job["send_unix"]), scheme, planes)
                self._requests[rid] = req
                self._seq += 1
                heapq.heappush(self._sends, (req.scheduled_unix, self._seq, rid))
            self._wake.notify()

    def _finish(self, req: _Request, status: Status, error: str | None = None) -> None:
        """End ``req`` once (the first caller wins); abandon its stream if still open."""
        with self._lock:
            if req.done:
                return
            req.done = True
            if req.stream is not None:
                self._by_stream.pop(req.stream.stream_id, None)
            self._requests.pop(req.request_id, None)
            stream = req.stream
        if stream is not None and not stream.state.terminal:
            try:
                stream.abandon(f"request {req.request_id}: {status.value}")
            except TransportError as exc:
                log.warning("could not abandon stream %d: %s", stream.stream_id, exc)
        self._emit("RESULT", req.result(status, error))

    def _send(self, req: _Request) -> None:
        job = req.job
        # as a decode node does: a LYNX residual held until it is wanted (here: at once when
        # every anchor is in, a first step that takes no time), unless the job says not to
        hold = bool(job.get("hold_residual", False)) and req.scheme is Scheme.LYNX
        request = KVRequest(req.request_id, req.scheme, req.planes, "ids",
                            self.address, job.get("bandwidth_gbps"), hold_residual=hold)
        payload = self._prompts[int(job["prompt_id"])]
        with self._lock:
            self._seq += 1
            heapq.heappush(self._deadlines, (time.time() + float(job["timeout_s"]), self._seq, req.request_id))
        try:
            conn = self._conn
            if conn is None or conn.broken is not None:
                if conn is not None:
                    conn.close()
                self._conn = conn = None
                self._conn = conn = self._connect()
            req.sent_unix = time.time()
            sent = conn.send_stream([("prompt", payload, int(Lane.ANCHOR))],
                                    metadata=request.to_metadata(), timeout=self._timeouts.connect_s)
        except TransportError as exc:
            if req.sent_unix is None:
                req.sent_unix = time.time()
            self._finish(req, Status.FAILED, f"sending the request: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            req.request_stream = sent
            self._unconfirmed.append(req)

    def _schedule_loop(self) -> None:
        try:
            self._schedule()
        except BaseException:  # the driver must hear of it, not wait out its timeout
            log.exception("the sink's scheduler failed; exiting")
            logging.shutdown()
            os._exit(70)  # the driver sees the exit and this log's tail

    def _schedule(self) -> None:
        while True:
            due: list[_Request] = []
            expired: list[_Request] = []
            with self._wake:
                if self._stopping:
                    return
                now = time.time()
                while self._sends and self._sends[0][0] <= now:
                    req = self._requests.get(heapq.heappop(self._sends)[2])
                    if req is not None:
                        due.append(req)
                while self._deadlines and self._deadlines[0][0] <= now:
                    req = self._requests.get(heapq.heappop(self._deadlines)[2])
                    if req is not None:
                        expired.append(req)
                confirmed = [r for r in self._unconfirmed if r.request_stream is not None
                             and r.request_stream.done()]
                self._unconfirmed = [r for r in self._unconfirmed if r not in confirmed]
            for req in due:
                self._send(req)
            for req in confirmed:
                assert req.request_stream is not None
                error = req.request_stream.exception()
                if error is not None:
                    self._finish(req, Status.FAILED, f"the request was not delivered: {error}")
            for req in expired:
                self._finish(req, Status.TIMEOUT, f"not finished {req.job['timeout_s']:g} s after it was sent")
            with self._wake:
                if self._stopping:
                    return
                wake = [t for t in (self._sends[0][0] if self._sends else None,
                                    self._deadlines[0][0] if self._deadlines else None) if t is not None]
                if self._unconfirmed:
                    wake.append(time.time() + POLL_S)
                if due or expired or confirmed:
                    continue
                self._wake.wait(max(0.0, min(wake) - time.time()) if wake else None)

    # -- transport callbacks (the listener's callback thread) -------------------------------------
    def _on_open(self, stream: ReceiveStream) -> None:
        now = time.time()
        error = parse_error_reply(stream.metadata)
        if error is not None:
            request_id, message = error
            self._release_on_complete.add(stream.stream_id)
            with self._lock:
                req = self._requests.get(request_id)
            if req is not None:
                status = Status.BUSY if message.startswith("busy") else Status.REFUSED
                self._finish(req, status, message)
            return
        try:
            request_id = KVHeader.from_metadata(stream.metadata).request_id
        except LynxError as exc:
            self._abandon(stream, f"not a KV stream: {exc}")
            return
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None:
                req.stream = stream
                req.bytes_anchor = sum(r.nbytes for r in stream.regions if r.lane == int(Lane.ANCHOR))
                req.bytes_residual = sum(r.nbytes for r in stream.regions if r.lane != int(Lane.ANCHOR))
                self._by_stream[stream.stream_id] = req
        if req is None:  # a stale answer (its request timed out) or a stranger: stop it now
            self._abandon(stream, f"no pending request {request_id}")
            return
        log.debug("request %s opened after %.3f s", request_id, now - (req.sent_unix or now))

    def _abandon(self, stream: ReceiveStream, reason: str) -> None:
        try:
            stream.abandon(reason)
        except TransportError as exc:
            log.warning("could not abandon stream %d: %s", stream.stream_id, exc)

    def _on_lane(self, stream: ReceiveStream, lane: int) -> None:
        if lane != int(Lane.ANCHOR):
            return
        now = time.time()
        with self._lock:
            req = self._by_stream.get(stream.stream_id)
            if req is not None and req.anchor_unix is None:
                req.anchor_unix = now
        if req is not None and req.job.get("hold_residual"):
            try:  # the anchors are in: ask for the residual, every lane after the anchor's
                for held in sorted(set(stream.manifest.lanes) - {int(Lane.ANCHOR)}):
                    stream.release_lane(held, self._timeouts.stream_s)  # a no-op when not held
            except TransportError as exc:
                log.warning("could not release the residual of stream %d: %s", stream.stream_id, exc)

    def _on_complete(self, stream: ReceiveStream) -> None:
        now = time.time()
        if stream.stream_id in self._release_on_complete:
            self._release_on_complete.discard(stream.stream_id)
            stream.release()
            return
        with self._lock:
            req = self._by_stream.get(stream.stream_id)
            if req is not None:
                req.full_unix = now
                if req.anchor_unix is None:
                    req.anchor_unix = now
        stream.release()
        if req is not None:
            self._finish(req, Status.COMPLETED)

    def _on_failed(self, stream: ReceiveStream, error: TransportError) -> None:
        self._release_on_complete.discard(stream.stream_id)
        with self._lock:
            req = self._by_stream.get(stream.stream_id)
        if req is not None:
            self._finish(req, Status.FAILED, f"the KV stream failed: {type(error).__name__}: {error}")

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(5.0)
        if self._conn is not None:
            self._conn.close()
        self._listener.close()

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, metavar="HOST:PORT", help="the prefill node")
    parser.add_argument("--listen-host", default="127.0.0.1", help="address replies come to")
    parser.add_argument("--context", type=int, required=True, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, required=True, help="prompts in the fixed set")
    parser.add_argument("--seed", type=int, required=True, help="seed of the prompt set")
    parser.add_argument("--vocab", type=int, required=True, help="token ids are drawn from [0, VOCAB)")
    parser.add_argument("--pool-bytes", type=int, required=True, help="receive pool size")
    parser.add_argument("--pool-wait", type=float, required=True, metavar="S",
                        help="a stream that does not fit in the pool waits this long for space")
    add_ucx_arguments(parser)
    add_timeout_arguments(parser)


def transport_config(args: argparse.Namespace, pool_wait_s: float) -> TransportConfig:
    """The decode node's :class:`TransportConfig` from its flags."""
    return TransportConfig(pool_wait_s=pool_wait_s, **ucx_settings(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lynx-load-sink")
    add_arguments(parser)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    server = host_port(args.connect, flag="--connect")
    emit = Emitter()
    prompts = prompt_set(args.seed, args.prompts, args.context, args.vocab)
    with Sink(server, prompts, emit=emit, listen_host=args.listen_host, pool_bytes=args.pool_bytes,
              timeouts=timeouts(args), config=transport_config(args, args.pool_wait)) as sink:
        emit("READY", {"address": list(sink.address)})
        for line in sys.stdin:
            if line.strip():
                sink.submit(json.loads(line)["jobs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
