"""The prefill node: takes prompts, prefills (or finds the cached prefill), encodes
the KV cache and streams it, anchor lane first, to the decode node that asked.
Many requests, from many decode nodes, at once.

Threads (threads + futures, like the transport):

* the listener's callback thread receives each request stream and *admits* it:
  at most ``max_pending`` requests are admitted and not yet finished (queued,
  prefilling or sending); past that the requester gets a ``busy`` error reply
  at once (:class:`~lynx_decode.errors.ServerBusyError` at the decode node),
  never an unbounded queue or a silent wait;
* one prefill worker (``lynx-prefill``) runs the prefills in arrival order (a
  prefill uses every core), each found first in a small in-memory cache of
  recent prompts (``memory_cache`` entries), then in the on-disk
  :class:`PrefillCache`. It encodes the cache before the send starts: into the
  form the request's is sent from and every form in ``prepare`` (by default INT8
  alone), and the memory cache holds those encoded forms
  (:class:`~lynx_decode.kvencode.EncodedCache`), not the float32 cache
  (``hold_native`` keeps it too). A LYNX split not named in ``prepare`` is
  sent from INT8 (its :func:`~lynx_decode.held_forms.held_as`): the same 8-bit
  codes and scales, from which the send cuts each layer's planes as it
  supplies them, so one INT8 cache per prompt serves the int8 pulls and every
  split (~0.3-1 ms of CPU a 4k-token layer of SmolLM2 on the send path, off it
  wherever a split pays: the layer's anchor takes longer on such a link). A later pull
  of a form not held (bf16, int4) reloads the float32 cache from disk (or
  prefills again) and encodes it. A model that is an
  :class:`~lynx_decode.kvencode.EncodedSource` (vLLM's producer, which encodes
  each layer as vLLM saves it) is asked for the held form first;
* each prefilled request is then sent by a thread of its own (``lynx-send``):
  its anchors at once, its held residual once the decode node releases it, and
  waiting for the confirmation, so one request's held residual never delays
  another's; the transport's lanes order the bytes of all of them (a new
  request's anchors go before older residuals);
* replies (and busy/error replies) go over one connection per decode node
  (its ``reply_to`` address), kept open for its next requests, all made through
  ONE egress of the transport (``Transport.egress``): one send scheduler and
  one link rate for every peer, so lane priority holds across requests and
  decode nodes (a new request's anchors go before any older residual, whoever
  it is for); a broken connection fails only that peer's requests and is
  dropped (the peer table forgets it). :meth:`serve` runs in the caller's
  thread until ``stop``.

Clock: ``t0_unix`` (sent in the KV header) is taken once the cache is held ready
to send, encoded in the form pulled: after the prefill (or finding it in a
cache) and its encoding, which the node's log line counts with the queue. The
stream's opening, the transfer, dequantization and the first decode step all
come after it (the log line's ``first anchor after``: t0 to the first anchor
region handed to the transport; ``first byte on the wire after``: t0 to the
stream's first chunk handed to UCX, ``SendRecord.first_byte_s``). Under
load the decode node also counts from the moment it sent its request (queueing
included). Both nodes must share a wall clock (same host, or synchronised hosts).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.errors import DecodeError
from lynx_decode.held_forms import DEFAULT_PREPARE, HeldForms, form_name, held_as
from lynx_decode.kvencode import EncodedCache, EncodedSource, encode_cache
from lynx_decode.kvsend import send_cache, warm_up_codec
from lynx_decode.model.protocol import CausalLM
from lynx_decode.prefill_cache import PrefillCache
from lynx_decode.request import BUSY_PREFIX, MAX_PROMPT_BYTES, KVRequest, error_reply
from lynx_decode.send_record import SendRecord
from lynx_decode.timeouts import Timeouts
from lynx_transport import UCX, Lane, Rate, ReceivePool, ReceiveStream, TransportConfig
from lynx_transport.errors import ConfigError, LynxError, TransportError
from lynx_transport.seam import ReceiverCallbacks, Sender, Transport

__all__ = ["PrefillNode", "DEFAULT_PREPARE"]

log = logging.getLogger("lynx_decode.prefill")

#: Link burst: a few chunks, so shaping is smooth at the chunk granularity.
BURST_BYTES = 1 << 20


@dataclasses.dataclass
class _Job:
    number: int
    request: KVRequest
    prompt: bytes
    peer: str
    admitted_at: float


class PrefillNode:
    """Serves KV caches of prompts to decode nodes (see the module docstring).

    ``cache``: the on-disk prefill cache (None disables it). ``memory_cache``:
    recent prefills kept in memory (0 disables it). ``max_pending``: requests
    admitted and not yet finished; more are refused as busy. ``link_rate``: the
    node's egress rate, all its replies to every decode node together (``None``:
    unshaped); a request's own ``bandwidth_gbps`` (the single-request sweep)
    caps its decode node's connection. ``timeouts``: every wait of the node (``stream_s`` bounds
    receiving a prompt and sending one cache up to the receiver's
    confirmation), its handshake and peer timeouts applied to ``config``.
    ``transport``: how bytes move (default: UCX). ``prepare``: the forms every
    prompt's cache is encoded into before its first send and held, with the one the
    request's is sent from (default INT8 alone, from which every split is cut as it is
    sent; a LYNX split named here is held ready instead: more memory, no cut on the
    send path);
    ``hold_native``: keep the float32 cache in memory too (default: only the
    encoded forms). ``on_sent``: called with each sent request's
    :class:`~lynx_decode.send_record.SendRecord` (on its send thread).
    """

    def __init__(self, model: CausalLM, *, host: str = "127.0.0.1", port: int = 0,
                 cache: PrefillCache | None = None, config: TransportConfig | None = None,
                 timeouts: Timeouts | None = None, transport: Transport = UCX,
                 clock: Callable[[], float] = time.time, max_pending: int = 32,
                 memory_cache: int = 4, link_rate: Rate | None = None,
                 prepare: tuple[CodecConfig, ...] = DEFAULT_PREPARE, hold_native: bool = False,
                 on_sent: Callable[[SendRecord], None] | None = None) -> None:
        if max_pending < 1:
            raise ConfigError(f"max_pending must be >= 1, got {max_pending}")
        if memory_cache < 0:
            raise ConfigError(f"memory_cache must be >= 0, got {memory_cache}")
        self.model = model
        self.cache = cache
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.config = self.timeouts.transport(config)
        self.stream_timeout_s = self.timeouts.stream_s
        self.transport = transport
        self.clock = clock
        self.max_pending = max_pending
        self.link_rate = link_rate
        self.prepare = tuple(dict.fromkeys(prepare))
        self.hold_native = hold_native
        self.on_sent = on_sent
        self._memory: collections.OrderedDict[tuple[int, ...], HeldForms] = collections.OrderedDict()
        self._memory_size = memory_cache
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._conns: dict[tuple[str, int], Sender] = {}
        self._connecting: dict[tuple[str, int], threading.Lock] = {}
        self._pending = 0
        self._numbers = itertools.count(1)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._sends = cf.ThreadPoolExecutor(max_workers=max_pending, thread_name_prefix="lynx-send")
        self._replies = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="lynx-reply")
        self._closed = False
        self.served = 0
        self.failed = 0
        self.refused = 0
        warm_up_codec()
        self._egress = transport.egress(self.config)
        if link_rate is not None:
            self._egress.set_link_rate(link_rate)
        self._worker = threading.Thread(target=self._prefill_loop, name="lynx-prefill", daemon=True)
        self._worker.start()
        #: where request streams land (each released once its prompt is read)
        self.pool = ReceivePool(4 * MAX_PROMPT_BYTES)
        self._receiver = transport.listen(
            self.pool, host=host, port=port, config=self.config,
            callbacks=ReceiverCallbacks(on_stream_complete=self._on_request))

    @property
    def address(self) -> tuple[str, int]:
        return self._receiver.address

    @property
    def pending(self) -> int:
        """Requests admitted and not yet finished (queued, prefilling or sending)."""
        with self._lock:
            return self._pending

    def peers(self) -> list[tuple[str, int]]:
        """The decode nodes this node holds a connection to (its peer table)."""
        with self._conn_lock:
            return list(self._conns)

    def serve(self, stop: threading.Event, *, poll_s: float = 0.2) -> None:
        """Serve until ``stop`` is set (requests are handled on the node's own threads);
        every ``poll_s`` forget the connections of decode nodes that went away."""
        while not stop.wait(poll_s):
            self.prune()

    def prune(self) -> None:
        """Close and forget every broken connection (a decode node that died or left)."""
        with self._conn_lock:
            gone = [(a, c) for a, c in self._conns.items() if c.broken is not None]
            for address, _ in gone:
                del self._conns[address]
                self._connecting.pop(address, None)
        for address, conn in gone:
            log.info("decode node %s:%d went away: %s", *address, conn.broken)
            conn.close()

    # -- admission (the listener's callback thread) -------------------------------------------
    def _on_request(self, stream: ReceiveStream) -> None:
        try:
            request = KVRequest.from_metadata(stream.metadata)
            prompt = bytes(memoryview(stream.view("prompt")))
        except (DecodeError, KeyError, TransportError) as exc:
            log.warning("ignoring a malformed request from %s: %s", stream.peer, exc)
            return
        finally:
            stream.release()
        with self._lock:
            admit = not self._closed and self._pending < self.max_pending
            if admit:
                self._pending += 1
            else:
                self.refused += 1
        if not admit:
            log.warning("request %s from %s refused: busy (%d pending, limit %d)",
                        request.request_id, stream.peer, self.max_pending, self.max_pending)
            self._replies.submit(self._send_error, request,
                                 f"{BUSY_PREFIX}the prefill node has {self.max_pending} requests "
                                 "pending; try again later")
            return
        self._jobs.put(_Job(next(self._numbers), request, prompt, stream.peer, time.monotonic()))

    # -- prefill (one worker) -----------------------------------------------------------------
    def _prefill_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._closed:
                self._finish(job, None, DecodeError("the prefill node closed"), tell=False)
                continue
            try:
                ids = self._token_ids(job.request, job.prompt)
                codec = _codec(job.request)
                encoded, held, nbytes = self._held(ids, codec)
                if encoded.config != codec:
                    held = f"{held}, {form_name(codec)} cut from {form_name(encoded.config)} as it is sent"
            except LynxError as exc:
                self._finish(job, None, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a failed prefill fails its request, not the node
                self._finish(job, None, DecodeError(f"prefill failed: {type(exc).__name__}: {exc}"))
                continue
            self._sends.submit(self._send, job, codec, encoded, held, nbytes)

    def _held(self, ids: list[int], pulled: CodecConfig) -> tuple[EncodedCache, str, int]:
        """The prompt's cache in a form a pull of ``pulled`` is sent from: ``pulled`` itself
        where it is held (a form in :attr:`prepare`), else
        :func:`~lynx_decode.held_forms.held_as` (a split's INT8 codes); how it was come by (held
        in memory, or prefilled (or found on disk) and encoded now, with the forms in
        :attr:`prepare`, all then held (with ``memory_cache`` 0 nothing is held, and only that
        form is encoded)); and the bytes held for the prompt."""
        forms = tuple(dict.fromkeys((pulled, held_as(pulled))))
        key = tuple(ids)
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                self._memory.move_to_end(key)
                for form in forms:
                    if form in entry.encoded:
                        return entry.encoded[form], f"held encoded, {entry.describe()}", entry.nbytes
        if isinstance(self.model, EncodedSource):  # a model that encoded the cache as it was made
            for form in forms:
                ready = self.model.encoded(ids, form)
                if ready is not None:
                    return ready, (f"held encoded as it was saved ({form_name(form)}, {ready.nbytes / 1e6:.1f} "
                                   f"MB, {ready.encode_s:.2f} s of encoding beside the prefill)"), ready.nbytes
        codec = pulled if pulled in self.prepare else forms[-1]
        start = time.monotonic()
        if entry is not None and entry.native is not None:
            native, source = entry.native, "prefill in memory"
        elif self.cache is not None:
            cached = self.cache.get_or_prefill(self.model, ids)
            native, source = cached.prefill, "prefill cached" if cached.hit else "prefilled"
        else:
            native, source = self.model.prefill(ids), "prefilled"
        loaded = time.monotonic()
        held = HeldForms({} if entry is None else dict(entry.encoded), native)
        # other forms only where they are held for later pulls (memory_cache 0: none are)
        for config in (codec, *(self.prepare if self._memory_size else ())):
            if config not in held.encoded:
                held.encoded[config] = encode_cache(native, self.model.info.layers, config)
        if not self.hold_native:
            held.native = None
        if self._memory_size:
            with self._lock:
                self._memory[key] = held
                while len(self._memory) > self._memory_size:
                    self._memory.popitem(last=False)
        return held.encoded[codec], (f"{source} in {loaded - start:.2f} s, encoded in "
                                     f"{time.monotonic() - loaded:.2f} s, {held.describe()}"), held.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of every prompt's cache held in memory (all their forms)."""
        with self._lock:
            return sum(entry.nbytes for entry in self._memory.values())

    def _token_ids(self, request: KVRequest, prompt: bytes) -> list[int]:
        if request.kind == "ids":
            if len(prompt) % 4:
                raise DecodeError("an ids prompt must be int32 token ids")
            return [int(t) for t in np.frombuffer(prompt, dtype="<i4")]
        try:
            text = prompt.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("a text prompt must be UTF-8") from None
        return self.model.chat_prompt(text) if request.kind == "chat" else self.model.tokenize(text)

    # -- sending (one thread per request) -----------------------------------------------------
    def _send(self, job: _Job, codec: CodecConfig, encoded: EncodedCache, source: str, held_bytes: int) -> None:
        request = job.request
        t0 = self.clock()
        start = time.monotonic()
        try:
            conn = self._connection(request.reply_to)
            # the request's own cap on its decode node's connection (None: uncapped)
            conn.set_link_rate(None if request.bandwidth_gbps is None
                               else Rate(request.bandwidth_gbps, BURST_BYTES))
            calling = time.monotonic()
            sending = send_cache(conn, encoded, self.model.info, codec,
                                 request_id=request.request_id, t0_unix=t0,
                                 hold_residual=request.hold_residual)
            sending.wait(self.stream_timeout_s)
        except TransportError as exc:
            self._drop(request.reply_to, conn_broken=True)
            self._finish(job, None, exc, tell=False)
            return
        except LynxError as exc:
            self._finish(job, None, exc)
            return
        regions = sending.stream.manifest.regions
        anchor = sum(r.nbytes for r in regions if r.lane == int(Lane.ANCHOR))
        residual = sum(r.nbytes for r in regions if r.lane != int(Lane.ANCHOR))
        bits = f" planes={','.join(map(str, request.planes))}" if request.scheme is Scheme.LYNX else ""
        sizes = f"anchor {anchor / 1e6:.1f} MB" + (f" + residual {residual / 1e6:.1f} MB" if residual else "")
        sent = time.monotonic() - start
        started = sending.stream.started_at
        record = SendRecord(request.request_id, request.scheme.value,
                            request.planes if request.scheme is Scheme.LYNX else None, t0,
                            start - job.admitted_at, calling - start + sending.first_supplied_s,
                            None if started is None else started - start, sent, anchor, residual, held_bytes)
        on_wire = ("" if record.first_byte_s is None
                   else f", first byte on the wire after {record.first_byte_s * 1e3:.1f} ms")
        self._finish(job, f"{len(encoded.token_ids)} tokens, {request.scheme.value}{bits}, {source}; "
                          f"{sizes}, first anchor after {record.first_supplied_s * 1e3:.1f} ms{on_wire}, "
                          f"sent in {sent:.2f} s ({record.queued_s:.2f} s queued, prefilling and encoding)")
        if self.on_sent is not None:
            try:
                self.on_sent(record)
            except Exception:  # a failed record must not fail the node
                log.exception("the send record of request %s was not taken", request.request_id)

    def _finish(self, job: _Job, summary: str | None, error: LynxError | None = None, *,
                tell: bool = True) -> None:
        """Log the request's line, tell its decode node if it failed, then count it
        (so whoever sees the counts sees the line and the reply too)."""
        where = f"request {job.number} from {job.peer}"
        if error is None:
            log.info("%s: %s", where, summary)
        else:
            log.warning("%s (%s) failed: %s", where, job.request.request_id, error)
            if tell:
                self._send_error(job.request, str(error))
        with self._lock:
            self._pending -= 1
            if error is None:
                self.served += 1
            else:
                self.failed += 1

    def _send_error(self, request: KVRequest, message: str) -> None:
        try:
            conn = self._connection(request.reply_to)
            # A manifest needs one region: the error travels as a one-byte stream.
            conn.send_stream([("error", b"\0", int(Lane.ANCHOR))],
                             metadata=error_reply(request.request_id, message)).wait(self.timeouts.stream_s)
        except TransportError as exc:
            log.warning("could not tell %s:%d that request %s failed: %s",
                        *request.reply_to, request.request_id, exc)
            self._drop(request.reply_to, conn_broken=True)

    # -- connections (the peer table) ---------------------------------------------------------
    def _connection(self, address: tuple[str, int]) -> Sender:
        with self._conn_lock:  # one connect per address at a time; other peers never wait on it
            lock = self._connecting.setdefault(address, threading.Lock())
        with lock:
            with self._conn_lock:
                if self._closed:
                    raise TransportError("the prefill node is closed")
                conn = self._conns.get(address)
                if conn is not None and conn.broken is None:
                    return conn
                stale = self._conns.pop(address, None)
            if stale is not None:
                stale.close()
            conn = self._egress.connect(address, timeout=self.timeouts.connect_s)
            with self._conn_lock:
                closed = self._closed
                if not closed:
                    self._conns[address] = conn
            if closed:
                conn.close()
                raise TransportError("the prefill node is closed")
            return conn

    def _drop(self, address: tuple[str, int], *, conn_broken: bool = False) -> None:
        """Forget a decode node's connection once it broke (its other requests fail on their own)."""
        with self._conn_lock:
            conn = self._conns.get(address)
            if conn is None or (conn_broken and conn.broken is None):
                return  # healthy: the failure was this request's own
            del self._conns[address]
            self._connecting.pop(address, None)
        conn.close()

    def close(self) -> None:
        """Stop admitting, fail what is in flight, close every connection and the listener."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._receiver.close()
        self._jobs.put(None)
        self._worker.join(self.timeouts.stream_s)
        with self._conn_lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()  # fails the streams still sending; their threads end
        self._egress.close()
        self._sends.shutdown(wait=True)
        self._replies.shutdown(wait=True)

    def __enter__(self) -> PrefillNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _codec(request: KVRequest) -> CodecConfig:
    """The form a request pulls."""
    if request.scheme is Scheme.LYNX:
        return CodecConfig(scheme=request.scheme, planes=request.planes)
    return CodecConfig(scheme=request.scheme)
