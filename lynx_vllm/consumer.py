"""The consumer's end: pull a request's cache from a producer and hand it over layer by layer.

:meth:`KVLoader.start` sends a pull request (a :class:`~lynx_decode.request.KVRequest`
with the prompt's token ids, the scheme and this loader's receiver address) to
the producer's prefill node; the cache comes back as a Lynx KV stream
(:mod:`lynx_decode.kvheader`) into this loader's pre-registered receive pool,
anchors first. :meth:`KVLoader.layer` waits for exactly one layer (every plane
of it: the connector loads the exact cache) and decodes it, on a Lynx thread of
:class:`~lynx_vllm.load_threads.LoadThreads` that writes each layer as it lands:
for a synchronous load (``load: "sync"``) while vLLM's forward waits for it in
``wait_for_layer_load``, so the first forward overlaps the transfer layer by
layer; for an asynchronous one (``load: "async"``) outside any forward.

Every failure is a :class:`~lynx_vllm.errors.LoadError` that comes at once, never
after a wait past the configured bounds: a refusal from the producer (its error
reply), a stream that does not fit this model (the stream is abandoned, the
producer told), a transport failure (a dead producer is noticed by its closed
socket, or by ``peer_timeout_s`` of silence), or ``timeout_s`` end to end.
A stream that failed is never decoded from.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lynx_decode.codec import decode_layer
from lynx_decode.codec.config import Scheme
from lynx_decode.errors import DecodeError
from lynx_decode.kvheader import KVHeader, region_name, request_id_of
from lynx_decode.kvsend import warm_up_codec
from lynx_decode.model.protocol import ModelInfo
from lynx_decode.request import KVRequest, parse_error_reply
from lynx_transport import UCX, Lane, ReceivePool, ReceiveStream
from lynx_transport.errors import LynxError, TransportError
from lynx_transport.seam import ReceiverCallbacks, Sender, Transport
from lynx_vllm.config import ConnectorConfig, LoadMode, Planes, resolve_split
from lynx_vllm.errors import LoadError

__all__ = ["KVLoader", "Load"]

log = logging.getLogger("lynx_vllm.consumer")


@dataclasses.dataclass
class Load:
    """One request's load: what vLLM asked for and how it went (times on the wall clock)."""

    request_id: str
    pull_id: str
    producer: tuple[str, int]
    scheme: Scheme
    planes: tuple[int, ...]
    prompt_tokens: int
    stream: cf.Future[ReceiveStream] = dataclasses.field(default_factory=cf.Future)
    header: KVHeader | None = None
    error: LoadError | None = None
    layers_loaded: int = 0
    #: tokens written into vLLM's blocks per layer (set by the connector)
    tokens_loaded: int = 0
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    deadline: float = 0.0
    mode: LoadMode = LoadMode.SYNC
    #: the scheme the request asked for (``scheme`` is what was pulled: INT8 when auto chose no split)
    asked: Scheme | None = None
    #: why auto chose this split (None: the split was given)
    split_choice: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def record(self) -> dict[str, Any]:
        """The load as one JSON-able record (what ``stats_path`` gets)."""
        header = self.header
        return {"request_id": self.request_id, "pull_id": self.pull_id, "scheme": self.scheme.value,
                "planes": list(self.planes) if self.scheme is Scheme.LYNX else None,
                "asked_scheme": (self.asked or self.scheme).value, "split_choice": self.split_choice,
                "load": self.mode.value, "prompt_tokens": self.prompt_tokens, "layers_loaded": self.layers_loaded,
                "tokens_loaded": self.tokens_loaded,
                "bytes_on_wire": None if header is None else sum(n for _, n, _ in header.regions()),
                "error": None if self.error is None else str(self.error), **self.times}


class KVLoader:
    """Pulls caches for one vLLM worker (see the module docstring). ``info``: the consumer's model;
    a stream that does not fit it is refused."""

    def __init__(self, info: ModelInfo, config: ConnectorConfig, *, transport: Transport = UCX,
                 pool_bytes: int = 1 << 30) -> None:
        self.info = info
        self.config = config
        self.timeouts = config.timeouts()
        self._transport_config = self.timeouts.transport(config.transport_config())
        self._transport = transport
        self._ids = itertools.count(1)
        self._nonce = f"{os.getpid():x}-{time.time_ns() & 0xFFFFFF:x}"
        self._lock = threading.Lock()
        self._waiting: dict[str, Load] = {}
        self._release_on_complete: set[int] = set()
        self._conns: dict[tuple[str, int], Sender] = {}
        self._conn_lock = threading.Lock()
        warm_up_codec()
        self._egress = transport.egress(self._transport_config)
        self._receiver = transport.listen(
            ReceivePool(pool_bytes), host=config.host, port=config.port, config=self._transport_config,
            callbacks=ReceiverCallbacks(on_stream_open=self._on_open, on_stream_complete=self._on_complete,
                                        on_stream_failed=self._on_failed))

    @property
    def address(self) -> tuple[str, int]:
        return self._receiver.address

    # -- the worker's side ---------------------------------------------------------------------
    def start(self, request_id: str, producer: tuple[str, int], prompt_ids: Sequence[int], *,
              scheme: Scheme, planes: Planes, mode: LoadMode = LoadMode.SYNC) -> Load:
        """Ask ``producer`` for the cache of ``prompt_ids[:-1]``. Never raises: a load that could not
        start comes back already failed. ``planes="auto"``: no split, the pull is INT8
        (:func:`~lynx_vllm.config.resolve_split`). ``mode`` only goes into the load's record."""
        pulled, split, why = resolve_split(scheme, planes)
        load = Load(request_id, f"{request_id}#{self._nonce}.{next(self._ids)}", producer, pulled, split,
                    len(prompt_ids), deadline=time.monotonic() + self.config.timeout_s, mode=mode,
                    asked=scheme, split_choice=why)
        scheme, planes = pulled, split
        load.times["requested_at"] = time.time()
        with self._lock:
            self._waiting[load.pull_id] = load
        try:
            pull = KVRequest(load.pull_id, scheme, planes if scheme is Scheme.LYNX else (4, 4), "ids",
                             self.address)
            payload = np.asarray(prompt_ids, dtype="<i4").view(np.uint8)
            conn = self._connection(producer)
            conn.send_stream([("prompt", payload, int(Lane.ANCHOR))], metadata=pull.to_metadata()
                             ).wait(self._left(load))
        except LynxError as exc:
            self._drop(producer)
            self.fail(load, LoadError(f"could not ask the producer {producer[0]}:{producer[1]}: {exc}"))
        return load

    def layer(self, load: Load, index: int) -> tuple[Any, Any]:
        """Layer ``index``'s K and V (float32 ``[kv_heads, tokens, head_dim]``), once every plane of it
        landed; :class:`LoadError` if the load failed or runs past its deadline."""
        if load.error is not None:
            raise load.error
        try:
            stream = load.stream.result(self._left(load))
        except cf.TimeoutError:
            self.fail(load, LoadError(f"the producer's KV stream did not open within {self.config.timeout_s} s"))
            raise load.error from None  # type: ignore[misc]
        except LoadError as exc:
            self.fail(load, exc)
            raise
        header = load.header
        assert header is not None
        layout = header.layout.layers[index]
        try:
            bufs = [stream.wait_region(region_name(index, p), self._left(load)) for p in range(layout.num_planes)]
        except LynxError as exc:
            self.fail(load, LoadError(f"the KV stream failed at layer {index}: {exc}"))
            raise load.error from None  # type: ignore[misc]
        if index == len(header.layout.layers) - 1:
            load.times["last_layer_landed_at"] = time.time()
        k, v = decode_layer(layout, *bufs)
        load.layers_loaded += 1
        return k, v

    def finish(self, load: Load, *, write: bool = True) -> dict[str, Any]:
        """End a load (whatever its outcome): the stream is released or abandoned, and (``write``)
        its record written to ``stats_path`` (else by :meth:`write_record`). Returns the record."""
        load.times.setdefault("finished_at", time.time())
        with self._lock:
            self._waiting.pop(load.pull_id, None)
        stream = load.stream.result() if load.stream.done() and load.stream.exception() is None else None
        if stream is not None:
            if load.error is None:
                try:  # every region landed: the stream completes (its confirmation) in a moment
                    stream.wait(min(1.0, self._left(load)))
                except LynxError:
                    pass
            wall, mono = time.time(), time.monotonic()  # the transport stamps lanes on the monotonic clock
            for lane, at in stream.lane_completed_at.items():
                load.times[f"lane{lane}_done_at"] = wall - (mono - at)
            if stream.state.terminal:
                if stream.exception() is None:
                    stream.release()
            else:
                self._end(stream, "the consumer finished without the rest of the stream")
        record = load.record()
        if load.error is None:
            log.info("loaded %s: %d tokens, %s, %.1f MB, %.3f s from the pull to the last layer",
                     load.request_id, load.prompt_tokens - 1, load.scheme.value, (record["bytes_on_wire"] or 0) / 1e6,
                     load.times.get("last_layer_landed_at", load.times["finished_at"]) - load.times["requested_at"])
        if write:
            self.write_record(record)
        return record

    def write_record(self, record: dict[str, Any]) -> None:
        """Append a load's record to ``stats_path`` (if set)."""
        path = self.config.stats_path
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def _left(self, load: Load) -> float:
        return max(0.0, load.deadline - time.monotonic())

    def fail(self, load: Load, error: LoadError) -> None:
        """Mark ``load`` failed with ``error`` (the first error stays); its waits raise it at once."""
        if load.error is None:
            load.error = error
            load.times["failed_at"] = time.time()
            log.warning("load of %s failed: %s", load.request_id, error)
        if not load.stream.done():
            load.stream.set_exception(error)

    def cancel(self, load: Load, reason: str) -> None:
        """Fail ``load`` (``reason``) and abandon its stream if one is open, so that a thread waiting in
        :meth:`layer` wakes at once with the load's error. Any thread."""
        self.fail(load, LoadError(reason))
        stream = load.stream.result() if load.stream.done() and load.stream.exception() is None else None
        if stream is not None and not stream.state.terminal:
            self._end(stream, reason)

    # -- transport callbacks (the receiver's callback thread) -----------------------------------
    def _on_open(self, stream: ReceiveStream) -> None:
        refusal = parse_error_reply(stream.metadata)
        pull_id = refusal[0] if refusal is not None else request_id_of(stream.metadata)
        with self._lock:
            load = self._waiting.get(pull_id) if pull_id else None
        if refusal is not None:
            self._release_on_complete.add(stream.stream_id)
            if load is not None:
                self.fail(load, LoadError(f"the producer refused: {refusal[1]}"))
            return
        if load is None:
            self._end(stream, "no pending load for this stream")
            return
        if load.failed:  # it timed out or was cancelled before its stream opened
            self._end(stream, f"the load already failed: {load.error}")
            return
        try:
            header = KVHeader.from_metadata(stream.metadata)
            header.check_model(self.info)
            if header.prompt_tokens != load.prompt_tokens or header.scheme is not load.scheme:
                raise DecodeError(f"the stream is a {header.scheme.value} cache of {header.prompt_tokens} tokens; "
                                  f"asked for {load.scheme.value}, {load.prompt_tokens}")
        except LynxError as exc:
            self.fail(load, LoadError(f"the producer's stream does not fit: {exc}"))
            self._end(stream, f"the consumer rejected the stream: {exc}")
            return
        load.header = header
        load.times["header_at"] = time.time()
        try:
            load.stream.set_result(stream)
        except cf.InvalidStateError:  # failed (fail() set the future) between the check above and here
            self._end(stream, f"the load already failed: {load.error}")

    def _on_complete(self, stream: ReceiveStream) -> None:
        if stream.stream_id in self._release_on_complete:
            self._release_on_complete.discard(stream.stream_id)
            stream.release()

    def _on_failed(self, stream: ReceiveStream, error: TransportError) -> None:
        self._release_on_complete.discard(stream.stream_id)  # the transport frees a failed stream
        pull_id = request_id_of(stream.metadata)
        with self._lock:
            load = self._waiting.get(pull_id) if pull_id else None
        if load is not None:
            self.fail(load, LoadError(f"the KV stream failed: {error}"))

    def _end(self, stream: ReceiveStream, reason: str) -> None:
        self._release_on_complete.add(stream.stream_id)
        try:
            stream.abandon(reason)
        except TransportError as exc:
            log.warning("could not abandon stream %d: %s", stream.stream_id, exc)
        if stream.state.terminal and stream.exception() is not None:
            self._release_on_complete.discard(stream.stream_id)

    # -- connections ---------------------------------------------------------------------------
    def _connection(self, producer: tuple[str, int]) -> Sender:
        with self._conn_lock:
            conn = self._conns.get(producer)
            if conn is not None and conn.broken is None:
                return conn
            stale = self._conns.pop(producer, None)
            if stale is not None:
                stale.close()
            conn = self._egress.connect(producer, timeout=self.timeouts.connect_s)
            self._conns[producer] = conn
            return conn

    def _drop(self, producer: tuple[str, int]) -> None:
        with self._conn_lock:
            conn = self._conns.pop(producer, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            loads, self._waiting = list(self._waiting.values()), {}
        for load in loads:
            self.fail(load, LoadError("the consumer closed"))
        with self._conn_lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        self._receiver.close()
        self._egress.close()
