"""A decode node's KV streams on the way in: the runs waiting for theirs
(:class:`AwaitedStream`, keyed by request id) and the streams in flight, each
with its :class:`~lynx_decode.kvassembler.KVAssembler`.

:class:`AwaitedStreams` holds that bookkeeping and the transport callbacks that
drive it (they run on the transport's callback thread): a stream opening hands
its assembler to the run waiting for it, or ends the stream (an error reply, a
stream that does not fit the model, one no run asked for); regions go to the
stream's assembler; lane completions are stamped for the run's metrics.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from lynx_decode.errors import DecodeError, ServerBusyError
from lynx_decode.kvassembler import KVAssembler
from lynx_decode.kvheader import request_id_of
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import CausalLM
from lynx_decode.request import BUSY_PREFIX, parse_error_reply
from lynx_transport import ReceivedRegion, ReceiveStream
from lynx_transport.errors import LynxError, TransportError

__all__ = ["AwaitedStream", "AwaitedStreams"]

log = logging.getLogger("lynx_decode.decode")

#: ``take(name, shape, headroom, owner)``: the cache buffers of one level for a stream's run.
TakeBuffers = Callable[[str, KVShape, int, "AwaitedStream | None"], KVBuffers]


@dataclasses.dataclass
class AwaitedStream:
    """A run waiting for its KV stream: the future the stream's opening resolves, the
    cache headroom it asked for, and the cache buffers taken for it (given back after)."""

    future: cf.Future[KVAssembler]
    headroom: int
    prior_gbps: float | None = None  # the link rate expected (asked for, or seen before)
    buffers: list[tuple[tuple[str, KVShape, int], KVBuffers]] = dataclasses.field(default_factory=list)


class AwaitedStreams:
    """The runs waiting for their KV streams and the streams in flight (one lock for
    both). ``take_buffers`` supplies each stream's cache buffers."""

    def __init__(self, model: CausalLM, take_buffers: TakeBuffers) -> None:
        self.model = model
        self._take_buffers = take_buffers
        self.pending: dict[str, AwaitedStream] = {}
        self.assemblers: dict[int, KVAssembler] = {}
        self.lane_done: dict[int, dict[int, float]] = {}
        self.release_on_complete: set[int] = set()
        self._lock = threading.Lock()

    def add(self, request_id: str, waiting: AwaitedStream) -> None:
        """A run now waits for the stream of ``request_id``."""
        with self._lock:
            self.pending[request_id] = waiting

    def discard(self, request_id: str) -> None:
        """The run of ``request_id`` waits no more."""
        with self._lock:
            self.pending.pop(request_id, None)

    def finish(self, stream_id: int) -> dict[int, float]:
        """Forget a stream its run is done with; when each of its lanes completed."""
        with self._lock:
            self.assemblers.pop(stream_id, None)
            return self.lane_done.pop(stream_id, {})

    def take_all(self) -> tuple[list[AwaitedStream], list[KVAssembler]]:
        """The runs still waiting (none wait from now on) and the assemblers in flight."""
        with self._lock:
            waiting, self.pending = list(self.pending.values()), {}
            return waiting, list(self.assemblers.values())

    # -- transport callbacks (callback thread) ------------------------------------------------
    def on_open(self, stream: ReceiveStream) -> None:
        error = parse_error_reply(stream.metadata)
        if error is not None:
            refused_id, message = error
            self.release_on_complete.add(stream.stream_id)
            with self._lock:
                waiting = self.pending.pop(refused_id, None)
            if waiting is not None and not waiting.future.done():
                cls = ServerBusyError if message.startswith(BUSY_PREFIX) else DecodeError
                waiting.future.set_exception(cls(f"the prefill node refused the request: {message}"))
            return
        request_id = request_id_of(stream.metadata)
        with self._lock:
            waiting = self.pending.get(request_id) if request_id else None
        headroom = waiting.headroom if waiting is not None else 0
        try:
            assembler = KVAssembler(
                stream, self.model.info, headroom=headroom,
                prior_gbps=waiting.prior_gbps if waiting is not None else None,
                allocate=lambda name, shape, room: self._take_buffers(name, shape, room, waiting))
        except Exception as exc:  # noqa: BLE001 - every refusal must end the stream and reach the run
            reason = exc if isinstance(exc, LynxError) else DecodeError(
                f"cannot take the KV stream: {type(exc).__name__}: {exc}")
            self.refuse(stream, request_id, reason)
            return
        with self._lock:
            self.assemblers[stream.stream_id] = assembler
            self.lane_done[stream.stream_id] = {}
            waiting = self.pending.pop(assembler.header.request_id, None)
        if waiting is None:
            log.warning("KV stream %d answers no pending request; dropping it", stream.stream_id)
            assembler.fail(DecodeError("no request for this stream"))
            with self._lock:
                self.assemblers.pop(stream.stream_id, None)
                self.lane_done.pop(stream.stream_id, None)
            self.end(stream, "no pending request for this stream")
            return
        waiting.future.set_result(assembler)

    def refuse(self, stream: ReceiveStream, request_id: str | None, reason: LynxError) -> None:
        """Refuse a KV stream at its opening: the waiting run hears ``reason`` at once,
        the stream ends (the sender is told) and its pool memory comes back."""
        log.warning("rejecting KV stream %d from %s: %s", stream.stream_id, stream.peer, reason)
        with self._lock:
            rejected = self.pending.pop(request_id, None) if request_id else None
        if rejected is not None and not rejected.future.done():
            rejected.future.set_exception(reason)  # before anything that could block
        self.end(stream, f"the decode node rejected the stream: {reason}")

    def end(self, stream: ReceiveStream, reason: str) -> None:
        """End a stream this node will not use: abandon it while it is live (the
        sender's stream fails with ``reason``); one that completed first is
        released when its completion callback comes (never while still active)."""
        self.release_on_complete.add(stream.stream_id)
        try:
            stream.abandon(reason)
        except TransportError as exc:  # the connection is going: the transport ends the stream
            log.warning("could not abandon stream %d: %s", stream.stream_id, exc)
        if stream.state.terminal and stream.exception() is not None:
            self.release_on_complete.discard(stream.stream_id)  # failed/cancelled: the transport frees it

    def on_complete(self, stream: ReceiveStream) -> None:
        if stream.stream_id in self.release_on_complete:
            self.release_on_complete.discard(stream.stream_id)
            stream.release()

    def on_region(self, stream: ReceiveStream, region: ReceivedRegion) -> None:
        assembler = self.assemblers.get(stream.stream_id)
        if assembler is not None:
            assembler.on_region(region)

    def on_lane(self, stream: ReceiveStream, lane: int) -> None:
        done = self.lane_done.get(stream.stream_id)
        if done is not None:
            done[lane] = time.time()

    def on_failed(self, stream: ReceiveStream, error: TransportError) -> None:
        self.release_on_complete.discard(stream.stream_id)  # the transport frees a failed stream
        assembler = self.assemblers.get(stream.stream_id)
        if assembler is not None:
            assembler.on_failed(error)
