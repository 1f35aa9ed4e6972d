"""The receiving side of a KV stream: :class:`KVAssembler` builds its caches
layer by layer as regions land (the wire convention is :mod:`lynx_decode.kvheader`).

It runs on the transport's callback thread. A stream of ``P`` planes builds
``P`` caches, one *level* per prefix of planes: level ``l`` of a layer is
dequantized once planes ``0..l`` of it have landed (level 0 is the anchor-only
draft, level ``P - 1`` the exact INT8 cache). One future per level resolves when
its cache is complete; a failed stream fails the futures still pending, so the
decode engine never waits past a transport error.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lynx_decode.codec import decode_layer
from lynx_decode.decode_config import CacheLevel
from lynx_decode.errors import DecodeError, LayoutError
from lynx_decode.kvheader import TOKENS, KVHeader, level_names, parse_region_name, region_name
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import ModelInfo
from lynx_transport import ReceivedRegion, ReceiveStream
from lynx_transport.errors import LynxError, TransportError

__all__ = ["KVAssembler", "arrival_eta"]

#: The share of a stream's bytes that must have landed before :func:`arrival_eta`
#: trusts the stream's own arrival rate over the prior one.
OWN_RATE_AFTER = 0.125


def arrival_eta(missing: int, landed: int, total: int, first: float | None, now: float,
                prior_gbps: float | None) -> float | None:
    """Seconds until a stream's ``missing`` bytes land: 0 when none are missing, else
    ``missing`` over a rate. The rate is ``prior_gbps`` (the link rate asked for, or the
    one the connection's last stream flowed at) until :data:`OWN_RATE_AFTER` of the
    stream's ``total`` bytes have landed after its first region, then the stream's own:
    ``landed`` bytes after the first region (which landed at ``first``; None: fewer than
    two regions in) over the time since. A stream's first regions come at the sender's
    pace in starting, not the link's (on loopback the first two ~2 ms apart, the next
    ones 0.2 ms), so an early own rate errs late by several times. Without a prior the
    own rate counts from the second region; a held lane's wait counts as time, so it
    errs late. None with neither."""
    if missing == 0:
        return 0.0
    own = first is not None and landed > 0 and now > first
    if prior_gbps is not None and (not own or landed < OWN_RATE_AFTER * total):
        return missing * 8 / (prior_gbps * 1e9)
    if not own:
        return None
    assert first is not None
    return missing * (now - first) / landed


class KVAssembler:
    """Builds the caches of one KV stream, one per level (prefix of planes), as its
    regions land.

    Feed it the transport callbacks of its stream (:meth:`on_region`,
    :meth:`on_failed`); read :attr:`levels` (for the decode engine), or
    :attr:`draft` (the anchor-only cache, ``None`` for one-plane schemes) and
    :attr:`full` (the exact cache) as futures resolving to :class:`KVBuffers`.
    ``headroom`` positions are reserved after the prompt for generated tokens.
    ``clock`` stamps :attr:`timings` and the arrivals (seconds on that clock).
    ``allocate(name, shape, headroom)`` supplies each level's buffers (names from
    :func:`level_names`; default: new ones); the decode node passes buffers it
    prepared before asking. ``prior_gbps``: the link rate expected (asked for, or
    seen on the connection's earlier streams), for :meth:`eta` until the stream's
    own arrivals give one.
    """

    def __init__(self, stream: ReceiveStream, info: ModelInfo, *, headroom: int = 64,
                 clock: Callable[[], float] = time.time,
                 allocate: Callable[[str, KVShape, int], KVBuffers] | None = None,
                 prior_gbps: float | None = None) -> None:
        self.stream = stream
        self.prior_gbps = prior_gbps
        self.header = KVHeader.from_metadata(stream.metadata)
        self.shape = self.header.check_model(info)
        expected = {(n, b, lane) for n, b, lane in self.header.regions()}
        got = {(r.name, r.nbytes, r.lane) for r in stream.regions}
        if expected != got:
            raise LayoutError("the stream's regions do not match its KV header "
                              f"({len(got)} regions, {len(expected)} expected)")
        self.clock = clock
        self.scheme = self.header.scheme
        self.num_planes = self.header.num_planes
        self.speculative = self.num_planes > 1
        self.names = level_names(self.num_planes)
        self._futures: list[cf.Future[KVBuffers]] = [cf.Future() for _ in self.names]
        self.full = self._futures[-1]
        self.draft: cf.Future[KVBuffers] | None = self._futures[0] if self.speculative else None
        self.timings: dict[str, float] = {}
        self.dequant_s = 0.0
        alloc = allocate or (lambda _name, shape, room: KVBuffers(shape, headroom=room))
        self._kv = [alloc(name, self.shape, headroom) for name in self.names]
        layers = self.shape.num_layers
        self._landed = np.zeros((self.num_planes, layers), dtype=bool)
        self._claimed = np.zeros((self.num_planes, layers), dtype=bool)  # level l of layer i taken for decoding
        self._arrivals: list[list[float]] = [[] for _ in range(self.num_planes)]
        #: bytes of each region, [plane][layer] (a sliding layer's are its window's)
        self.layer_bytes = [[layer.plane_size(p) for layer in self.header.layout.layers]
                            for p in range(self.num_planes)]
        self._total_bytes = sum(sum(plane) for plane in self.layer_bytes)
        self._first_arrival: float | None = None
        self._last_arrival: float | None = None
        self._bytes_after_first = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a region landed, a layer was decoded, a failure
        self._failed = False
        #: Closed: levels above the anchor wait; see :meth:`open_full_gate`.
        self.full_gate = threading.Event()
        if not self.speculative:
            self.full_gate.set()
        self._deferred: list[tuple[int, int]] = []
        self.token_ids: tuple[int, ...] | None = None
        self._tokens_future: cf.Future[tuple[int, ...]] = cf.Future()

    @property
    def arrivals(self) -> list[list[float]]:
        """When each region of each plane landed (on :attr:`clock`), per plane, in arrival order."""
        return self._arrivals

    @property
    def levels(self) -> list[CacheLevel]:
        """The caches the decode engine drafts on and verifies against, coarsest
        first: each with its future, its buffers while they fill, and an estimate
        of when it completes."""
        return [CacheLevel(future, kv, functools.partial(self.eta, level), functools.partial(self.take, level))
                for level, (future, kv) in enumerate(zip(self._futures, self._kv))]

    def take(self, level: int, layer: int, timeout: float = 0.0) -> bool:
        """Make layer ``layer`` of level ``level`` readable if its planes land within
        ``timeout`` seconds (0: only if they are in now): one the gate held back
        (:meth:`open_full_gate`) is dequantized here, on the calling thread, the
        engine's, which is about to read it. True when it is readable; False when
        its bytes did not all come in time, or the stream failed."""
        kv = self._kv[level]
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if kv.written(layer):
                    return True
                if (layer, level) in self._deferred:
                    self._deferred.remove((layer, level))
                    break
                left = deadline - time.monotonic()
                if self._failed or left <= 0:
                    return False
                self._changed.wait(left)  # (a layer another thread decodes notifies when written)
        self._decode_level(layer, level)
        return True

    def eta(self, level: int) -> float | None:
        """Seconds until every region of planes ``0..level`` has landed (0 when in; None
        when nothing gives a rate): see :func:`arrival_eta`."""
        with self._lock:
            first, last, landed = self._first_arrival, self._last_arrival, self._bytes_after_first
            missing = sum(int(np.dot(~self._landed[p], self.layer_bytes[p])) for p in range(level + 1))
        flowing = first if first is not None and last is not None and last > first else None
        return arrival_eta(missing, landed, self._total_bytes, flowing, self.clock(), self.prior_gbps)

    # -- callbacks (transport callback thread) ---------------------------------------------
    def on_region(self, region: ReceivedRegion) -> None:
        ended = self.stream.exception()
        if ended is not None:  # a callback queued before the stream failed: its views are gone
            self.fail(ended)
            return
        try:
            self._on_region(region)
        except LynxError as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the decode thread
            self.fail(DecodeError(f"assembling region {region.name}: {type(exc).__name__}: {exc}"))

    def on_failed(self, error: TransportError) -> None:
        self.fail(error)

    def fail(self, error: BaseException) -> None:
        with self._changed:
            self._failed = True
            self._changed.notify_all()
        futures: list[cf.Future[Any]] = [self._tokens_future, *self._futures]
        for future in futures:
            if not future.done():
                with contextlib.suppress(cf.InvalidStateError):  # resolved meanwhile: it stands
                    future.set_exception(error)
        for kv in self._kv:
            kv.abort(error)

    def prompt_ids(self, timeout: float) -> tuple[int, ...]:
        """The prompt's token ids (all of them), once the ``tokens`` region landed."""
        try:
            return self._tokens_future.result(timeout)
        except cf.TimeoutError:
            raise DecodeError(f"the prompt tokens did not arrive within {timeout} s") from None

    def _on_region(self, region: ReceivedRegion) -> None:
        view = self.stream.view(region.name)
        if region.name == TOKENS:
            ids = np.frombuffer(memoryview(view), dtype=np.int32).copy()
            if len(ids) != self.header.prompt_tokens or (ids < 0).any():
                raise DecodeError("the stream's prompt tokens are malformed")
            self.token_ids = tuple(int(t) for t in ids)
            self._tokens_future.set_result(self.token_ids)
            return
        layer, plane = parse_region_name(region.name, self.shape.num_layers, self.num_planes)
        now = self.clock()
        ready = []
        with self._lock:
            self._landed[plane, layer] = True
            self._arrivals[plane].append(now)
            if len(self._arrivals[plane]) == 1:
                self.timings[f"plane{plane}_first"] = now
            if self._first_arrival is None:
                self._first_arrival = now
            else:
                self._bytes_after_first += self.layer_bytes[plane][layer]
            self._last_arrival = now
            gate_open = self.full_gate.is_set()
            for level in range(self.num_planes):
                if self._claimed[level, layer] or not self._landed[: level + 1, layer].all():
                    continue
                if level > 0 and not gate_open:
                    self._claimed[level, layer] = True
                    self._deferred.append((layer, level))
                    continue
                self._claimed[level, layer] = True
                ready.append(level)
            self._changed.notify_all()
        for level in ready:
            self._decode_level(layer, level)

    def open_full_gate(self) -> None:
        """Let the levels above the anchor be dequantized (call once the first token
        is out, or at once).

        A multi-plane stream dequantizes levels 1.. only after the gate opens, so
        the first draft step does not share CPU and memory bandwidth with
        rebuilding the finer caches; layers that landed before are decoded then,
        on the calling thread, level by level. Idempotent and thread-safe."""
        with self._lock:
            if self.full_gate.is_set():
                return
            self.full_gate.set()
            pending, self._deferred = self._deferred, []
        try:
            for layer, level in sorted(pending, key=lambda p: (p[1], p[0])):
                self._decode_level(layer, level)
        except LynxError as exc:
            self.fail(exc)

    def _decode_level(self, layer: int, level: int) -> None:
        layout = self.header.layout.layers[layer]
        kv = self._kv[level]
        bufs = [self.stream.view(region_name(layer, p)) for p in range(level + 1)]
        start = time.perf_counter()
        k, v = kv.layer(layer)  # decode straight into the model cache: no temporary, no copy
        decode_layer(layout, *bufs, out_k=k, out_v=v)
        kv.mark_written(layer)
        future = self._futures[level]
        with self._lock:  # two threads may finish layers of one level (callbacks, the gate's opener)
            self._changed.notify_all()
            self.dequant_s += time.perf_counter() - start
            if not kv.complete or future.done():
                return
            self.timings[f"{self.names[level]}_ready"] = self.clock()
            future.set_result(kv)
