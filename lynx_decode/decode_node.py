"""The decode node: asks a prefill node for a prompt's KV cache, receives it into
a pre-registered pool, and decodes (speculatively on the anchors for LYNX).

Threads: the transport's callback thread runs :class:`KVAssembler` (dequantizes
each landed region into the draft/full cache); :meth:`DecodeNode.run` runs the
decode engine in the caller's thread, whose first model step starts as soon as
the stream opens and waits inside each layer for that layer's K/V (its compute
overlaps the transfer). Several runs may go at once, from several threads (a
load generator's requests): each has its own KV stream, cache buffers and
engine; the node keeps one connection per prefill node for all of them.

Transport: any :class:`~lynx_transport.seam.Transport` (default the real UCX
one; ``lynx_transport.testing.MemoryTransport`` in tests). Timeouts: one
:class:`~lynx_decode.timeouts.Timeouts`.

Metrics (docs/design.md names): ``ttft_s``, ``ttfct_s`` and ``e2e_s`` count from the
prefill node's ``t0_unix`` (sent in the KV header) on the shared wall clock: the
single-request sweep's clock, which leaves the prefill node's queue and prefill
out. Under load, the clock a user feels starts when this node sent its request:
``ttft_from_request_s``, ``ttfct_from_request_s``, ``e2e_from_request_s``
(``queue_s`` = ``t0`` - request time: queueing and prefill at the prefill node).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from lynx_decode.awaited_streams import AwaitedStream, AwaitedStreams
from lynx_decode.codec.config import DEFAULT_ANCHOR_BITS, CodecConfig, Scheme
from lynx_decode.decode_config import DEFAULT_MAX_DRAFT, DecodeConfig, MissingFull
from lynx_decode.errors import DecodeError, PromptError
from lynx_decode.events import Committed, Event, Tentative
from lynx_decode.kvassembler import KVAssembler
from lynx_decode.kvheader import cache_bytes, lane_of, level_names
from lynx_decode.kvsend import warm_up_codec
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import CausalLM
from lynx_decode.request import KVRequest, PromptKind
from lynx_decode.run_metrics import run_metrics
from lynx_decode.speculative import generate
from lynx_decode.split_choice import DEFAULT_STEP_S, SplitChoice, choose_split_or_default
from lynx_decode.timeouts import Timeouts
from lynx_transport import UCX, Lane, ReceivePool, ReceiveStream, TransportConfig
from lynx_transport.errors import ClosedError, StreamFailedError, TransportError
from lynx_transport.seam import ReceiverCallbacks, Sender, Transport

__all__ = ["DecodeNode", "RunResult"]

log = logging.getLogger("lynx_decode.decode")

DEFAULT_POOL_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One generation: the tokens, the text and the metrics (docs/design.md names)."""

    tokens: tuple[int, ...]
    text: str
    metrics: dict[str, Any]


class DecodeNode:
    """Receives KV streams from prefill nodes and decodes them.

    ``host``: the address prefill nodes connect back to (127.0.0.1 unless the
    nodes sit in different network namespaces). ``pool_bytes``: the receive pool,
    allocated once; it must hold one whole stream. ``timeouts``: every wait of
    the node, its handshake and peer timeouts applied to ``config``.
    ``transport``: how bytes move (default: UCX).
    """

    def __init__(self, model: CausalLM, *, host: str = "127.0.0.1",
                 pool_bytes: int = DEFAULT_POOL_BYTES, config: TransportConfig | None = None,
                 timeouts: Timeouts | None = None, transport: Transport = UCX) -> None:
        self.model = model
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.timeout_s = self.timeouts.stream_s
        self.transport = transport
        self._transport_config = self.timeouts.transport(config)
        self._streams = AwaitedStreams(model, self._take_buffers)
        self._kv_free: dict[tuple[str, KVShape, int], list[KVBuffers]] = {}
        #: what ``planes="auto"`` knows: the link rate seen per server (t0 to the last byte),
        #: the decode step seen; and the rate bytes flowed at, for the next stream's estimates
        self._seen_gbps: dict[tuple[str, int], float] = {}
        self._seen_flow_gbps: dict[tuple[str, int], float] = {}
        self._seen_step_s: float | None = None
        self._conns: dict[tuple[str, int], Sender] = {}
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()
        warm_up_codec()
        self._receiver = transport.listen(
            ReceivePool(pool_bytes), host=host, config=self._transport_config,
            callbacks=ReceiverCallbacks(
                on_stream_open=self._streams.on_open, on_region=self._streams.on_region,
                on_lane_complete=self._streams.on_lane, on_stream_complete=self._streams.on_complete,
                on_stream_failed=self._streams.on_failed))

    @property
    def address(self) -> tuple[str, int]:
        return self._receiver.address

    # -- cache buffers ------------------------------------------------------------------------
    #: Free cache buffers kept per (name, shape, headroom) for the next runs.
    KEEP_FREE = 2

    def _take_buffers(self, name: str, shape: KVShape, headroom: int,
                      owner: AwaitedStream | None) -> KVBuffers:
        """``name`` ("draft"/"full") cache buffers for ``shape``: a free pre-faulted set
        when one is left from an earlier run (see :meth:`prepare`), else new ones.
        Concurrent runs each get their own; :meth:`_give_back` returns them."""
        key = (name, shape, headroom)
        with self._lock:
            free = self._kv_free.get(key)
            kv = free.pop() if free else None
        if kv is None:
            kv = KVBuffers(shape, headroom=headroom).prefault()
        kv.reset()
        if owner is not None:
            owner.buffers.append((key, kv))
        return kv

    def _give_back(self, buffers: list[tuple[tuple[str, KVShape, int], KVBuffers]]) -> None:
        with self._lock:
            for key, kv in buffers:
                # keep the buffers of the latest shape only (a new prompt length frees the rest)
                for other in [k for k in self._kv_free if k[0] == key[0] and k != key]:
                    del self._kv_free[other]
                free = self._kv_free.setdefault(key, [])
                if len(free) < self.KEEP_FREE:
                    free.append(kv)

    def prepare(self, prompt_tokens: int, *, max_new_tokens: int = 32,
                max_draft: int = DEFAULT_MAX_DRAFT, planes: int = 2) -> None:
        """Allocate and pre-fault the cache buffers (one set per level of a stream of
        ``planes`` planes) for a prompt of ``prompt_tokens`` tokens before asking for
        it (``run`` does this when it is given token ids), so page faults of fresh
        memory are not counted in the time to first token."""
        if prompt_tokens < 2:
            raise PromptError(_too_short(prompt_tokens))
        headroom = max_new_tokens + max_draft + 2
        shape = self.model.info.kv_shape(prompt_tokens - 1)
        with self._lock:
            ready = {name: bool(self._kv_free.get((name, shape, headroom))) for name in level_names(planes)}
        made = [((name, shape, headroom), KVBuffers(shape, headroom=headroom).prefault())
                for name, have in ready.items() if not have]
        self._give_back(made)

    # -- one run ---------------------------------------------------------------------------

    def run(self, server: tuple[str, int], prompt: str | list[int], *, scheme: Scheme,
            max_new_tokens: int = 32, anchor_bits: int = DEFAULT_ANCHOR_BITS,
            planes: tuple[int, ...] | Literal["auto"] | None = None, kind: PromptKind = "text",
            bandwidth_gbps: float | None = None, max_draft: int = DEFAULT_MAX_DRAFT,
            on_missing_residual: MissingFull = MissingFull.FAIL, hold_residual: bool = False,
            on_event: Callable[[Event], None] | None = None) -> RunResult:
        """Request ``prompt``'s cache from ``server`` and decode ``max_new_tokens`` tokens.

        Raises :class:`DecodeError` (the prefill node refused, the stream does not
        fit the model, a timeout) or a :class:`TransportError` (connection lost);
        tokens reported as tentative before a failure are never committed.

        A residual that never arrives (the stream failed after its anchors — a dead
        or silent prefill node is detected within the transport's peer timeout — or
        the node's ``timeouts.residual_s`` passed once drafting started): ``MissingFull.FAIL``
        raises; ``MissingFull.UNVERIFIED`` finishes on the anchors and returns the
        tokens with ``metrics["verified"] = False`` (events: ``Unverified``).

        ``planes``: the LYNX split (default ``(anchor_bits, 8 - anchor_bits)``);
        ``"auto"`` (with ``scheme=LYNX``) chooses it for the link and the prompt
        (:func:`lynx_decode.split_choice.choose_split`: from ``bandwidth_gbps``, else
        the rate seen on this server's earlier streams, and the decode step seen on
        earlier runs), possibly no split at all (then the run is INT8);
        ``metrics["split_choice"]`` says what was chosen and why.
        ``hold_residual`` (LYNX with drafting; default off): the prefill node sends
        the lanes after the anchor's only once this node drafted its first token,
        so their reception does not compete with the first model step for the
        CPU; it costs the link the time of that step's last layers and a round
        trip. Off, the residual follows the anchors at once and the verify pass
        rides on its arrival; both settings give the same clocks (docs/design.md,
        "Measured facts").
        """
        request_id = uuid.uuid4().hex
        if isinstance(prompt, str):
            if not prompt.strip() and kind != "chat":
                raise PromptError("the prompt is empty")
            payload = prompt.encode("utf-8")
        else:
            if len(prompt) < 2:
                raise PromptError(_too_short(len(prompt)))
            kind = "ids"
            limit = self.model.info.max_positions
            if len(prompt) + max_new_tokens > limit:
                raise PromptError(f"the prompt has {len(prompt)} tokens; with {max_new_tokens} new "
                                  f"tokens it exceeds the model's context window of {limit}")
            payload = np.asarray(prompt, dtype="<i4").tobytes()
        choice = None
        if planes == "auto":
            if scheme is Scheme.LYNX:
                choice = self._choose_split(server, prompt, kind, bandwidth_gbps)
                scheme = Scheme.LYNX if choice.planes is not None else Scheme.INT8
            planes = None if choice is None else choice.planes
        split = (CodecConfig(planes=planes) if planes is not None else CodecConfig(bits=anchor_bits)).planes
        if isinstance(prompt, list):
            self.prepare(len(prompt), max_new_tokens=max_new_tokens, max_draft=max_draft,
                         planes=len(split) if scheme is Scheme.LYNX else 1)
        hold = hold_residual and scheme is Scheme.LYNX and max_draft > 0
        request = KVRequest(request_id, scheme, split, kind, self.address, bandwidth_gbps,
                            hold_residual=hold)
        waiting = AwaitedStream(cf.Future(), max_new_tokens + max_draft + 2,
                           bandwidth_gbps if bandwidth_gbps is not None else self._seen_flow_gbps.get(server))
        self._streams.add(request_id, waiting)
        try:
            result = self._run(server, request, payload, waiting, max_new_tokens=max_new_tokens,
                               max_draft=max_draft, hold=hold, on_missing_residual=on_missing_residual,
                               on_event=on_event)
            self._learn(server, result.metrics)
            result.metrics["planes"] = list(split) if scheme is Scheme.LYNX else None
            result.metrics["split_choice"] = None if choice is None else choice.reason
            return result
        finally:
            self._streams.discard(request_id)
            self._give_back(waiting.buffers)

    def _choose_split(self, server: tuple[str, int], prompt: str | list[int], kind: PromptKind,
                      bandwidth_gbps: float | None) -> SplitChoice:
        if isinstance(prompt, list):
            tokens = len(prompt)
        else:
            tokens = len(self.model.chat_prompt(prompt) if kind == "chat" else self.model.tokenize(prompt))
        int8_bytes = cache_bytes(self.model.info.layers, max(1, tokens - 1), CodecConfig(Scheme.INT8))
        rate = bandwidth_gbps if bandwidth_gbps is not None else self._seen_gbps.get(server)
        return choose_split_or_default(int8_bytes, rate, self._seen_step_s or DEFAULT_STEP_S)

    def _learn(self, server: tuple[str, int], m: dict[str, Any]) -> None:
        """Remember the link rate and the decode step this run saw (for ``planes="auto"``)."""
        ends = [t for t in (m.get("transfer_anchor_s"), m.get("transfer_residual_s")) if t]
        if ends and m.get("bytes_total"):
            self._seen_gbps[server] = m["bytes_total"] * 8 / max(ends) / 1e9
        times = [t for plane in m.get("arrivals_s") or () for t in plane]
        if len(times) > 1 and max(times) > min(times) and m.get("bytes_total"):
            # the rate bytes came at once flowing (t0 to the first region is the prefill
            # node's start, not the link's): the next stream's arrival estimate starts on it
            self._seen_flow_gbps[server] = m["bytes_total"] * 8 / (max(times) - min(times)) / 1e9
        step = m.get("step_s")
        if step is not None:
            self._seen_step_s = step if self._seen_step_s is None else 0.5 * (self._seen_step_s + step)

    def _run(self, server: tuple[str, int], request: KVRequest, payload: bytes, waiting: AwaitedStream, *,
             max_new_tokens: int, max_draft: int, hold: bool, on_missing_residual: MissingFull,
             on_event: Callable[[Event], None] | None) -> RunResult:
        conn = self._connection(server)
        requested_at = time.time()  # the clock a user under load feels starts here
        try:
            conn.send_stream([("prompt", np.frombuffer(payload, np.uint8), int(Lane.ANCHOR))],
                             metadata=request.to_metadata()).wait(self.timeout_s)
        except TransportError:
            self._drop(server, conn)
            raise
        assembler = _result(waiting.future, self.timeout_s, "the KV stream did not open")
        stream = assembler.stream
        first_token: list[float] = []
        released = threading.Event()  # a held residual was asked for
        levels = assembler.levels
        if hold:  # a held residual is due only once released: the engine must not wait for it
            levels = [level if i == 0 else dataclasses.replace(level, eta=_once(released, level.eta))
                      for i, level in enumerate(levels)]

        def events(event: Event) -> None:
            first = isinstance(event, Tentative | Committed) and not first_token
            if first:
                first_token.append(time.time())
                if hold:  # the first token is out: let the residual come ...
                    _release_residual(stream, assembler.num_planes, self.timeout_s)
                    released.set()
            if on_event is not None:  # the caller sees the token before the gate's work below
                on_event(event)
            if first:
                assembler.open_full_gate()  # ... and rebuild the finer caches as they land

        if max_draft == 0:
            assembler.open_full_gate()
        try:
            ids = assembler.prompt_ids(self.timeout_s)
            config = DecodeConfig(max_new_tokens=max_new_tokens,
                                  max_draft=max_draft if assembler.speculative else 0,
                                  wait_timeout_s=self.timeout_s,
                                  full_timeout_s=self.timeouts.residual_s,
                                  on_missing_full=on_missing_residual,
                                  step_s=self._seen_step_s or DEFAULT_STEP_S)
            # the first step starts now and waits inside each layer for its K/V
            gen = generate(self.model, ids, levels=levels, config=config,
                           t0=assembler.header.t0_unix, clock=time.time, on_event=events)
            if gen.metrics.verified:
                stream.wait(self.timeout_s)
        except StreamFailedError as exc:
            raise DecodeError(f"the KV stream failed: {exc}") from exc
        finally:
            if stream.state.terminal:
                stream.release()  # failed/cancelled streams are released by the transport
            else:
                # Still receiving (a stalled residual, or the run failed): give the
                # stream up; the sender is told and the transport frees its pool memory.
                stream.abandon("the decode node finished without the rest of the stream")
            lane_done = self._streams.finish(stream.stream_id)
        return RunResult(gen.tokens, self.model.detokenize(gen.tokens),
                         run_metrics(assembler, gen, lane_done, first_token, requested_at))

    def _connection(self, server: tuple[str, int]) -> Sender:
        """The connection to ``server``, kept open for the next runs (one connect at a time)."""
        with self._conn_lock:
            conn = self._conns.get(server)
            if conn is not None and conn.broken is None:
                return conn
            if conn is not None:
                conn.close()
            conn = self._conns[server] = self.transport.connect(
                server, timeout=self.timeouts.connect_s, config=self._transport_config)
            return conn

    def _drop(self, server: tuple[str, int], conn: Sender) -> None:
        with self._conn_lock:
            if self._conns.get(server) is conn:
                del self._conns[server]
        conn.close()

    def close(self) -> None:
        """Close the node: runs still waiting fail at once (``ClosedError``), streams in
        flight fail, connections and the listener close."""
        waiting, assemblers = self._streams.take_all()
        closed = ClosedError("the decode node was closed")
        for w in waiting:
            if not w.future.done():
                w.future.set_exception(closed)
        for assembler in assemblers:
            assembler.fail(closed)
        with self._conn_lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        self._receiver.close()

    def __enter__(self) -> DecodeNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result(future: cf.Future[KVAssembler], timeout: float, what: str) -> KVAssembler:
    try:
        return future.result(timeout)
    except cf.TimeoutError:
        raise DecodeError(f"{what} within {timeout} s") from None


def _release_residual(stream: ReceiveStream, planes: int, timeout: float) -> None:
    try:
        for plane in range(1, planes):
            stream.release_lane(lane_of(plane), timeout)
    except TransportError as exc:  # the stream fails on its own; the run reports that
        log.warning("could not release the residual of stream %d: %s", stream.stream_id, exc)


def _too_short(tokens: int) -> str:
    if tokens == 0:
        return "the prompt is empty"
    return (f"the prompt has {tokens} token; a prompt needs at least 2 tokens (the cache covers all "
            "but the last, which the decode node runs itself)")


def _once(event: threading.Event, eta: Callable[[], float | None] | None) -> Callable[[], float | None]:
    """``eta``, unknown (None) until ``event`` is set."""
    return lambda: eta() if eta is not None and event.is_set() else None
