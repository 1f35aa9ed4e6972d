"""The prefill node: takes prompts, prefills (or loads the cached prefill), encodes
the KV cache and streams it, anchor lane first, to the decode node that asked.

Threads: :meth:`PrefillNode.serve` runs in the caller's thread and handles one
request at a time (a prefill uses every core; requests queue in the transport).
Each reply goes over a connection to the requester's ``reply_to`` address that
is kept open for the next request from the same decode node.

Clock: ``t0_unix`` (sent in the KV header) is taken once the cache is held in its
native precision: after the prefill, or after loading it from the disk cache.
Encoding, transfer, dequantization and the first decode step all come after it.
Both nodes must share a wall clock (same host, or synchronised hosts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lynx_decode.codec_config import CodecConfig, Scheme
from lynx_decode.kvstream import send_cache, warm_up_codec
from lynx_decode.model.protocol import CausalLM
from lynx_decode.prefill_cache import PrefillCache
from lynx_decode.request import MAX_PROMPT_BYTES, KVRequest, error_reply
from lynx_transport import Connection, Lane, Rate, ReceivePool, Receiver, ReceiveStream, TransportConfig, connect
from lynx_transport.errors import DecodeError, LynxError, TransportError, TransportTimeoutError

__all__ = ["PrefillNode"]

log = logging.getLogger("lynx_decode.prefill")

#: Link burst: a few chunks, so shaping is smooth at the chunk granularity.
BURST_BYTES = 1 << 20


class PrefillNode:
    """Serves KV caches of prompts to decode nodes (see the module docstring).

    ``cache``: the on-disk prefill cache (None disables it).
    ``stream_timeout_s``: bound on sending one cache (the receiver's confirmation).
    """

    def __init__(self, model: CausalLM, *, host: str = "127.0.0.1", port: int = 0,
                 cache: PrefillCache | None = None, config: TransportConfig | None = None,
                 stream_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.model = model
        self.cache = cache
        self.config = config if config is not None else TransportConfig()
        self.stream_timeout_s = stream_timeout_s
        self.clock = clock
        warm_up_codec()
        self._receiver = Receiver(ReceivePool(2 * MAX_PROMPT_BYTES), host=host, port=port,
                                  config=self.config)
        self._conns: dict[tuple[str, int], Connection] = {}
        self.served = 0

    @property
    def address(self) -> tuple[str, int]:
        return self._receiver.address

    def serve(self, stop: threading.Event, *, poll_s: float = 0.2) -> None:
        """Handle requests until ``stop`` is set."""
        while not stop.is_set():
            try:
                stream = self._receiver.next_stream(timeout=poll_s)
            except TransportTimeoutError:
                continue
            self.handle(stream)

    def handle(self, stream: ReceiveStream) -> None:
        """Answer one request stream; failures go back to the requester as an error reply."""
        try:
            request = KVRequest.from_metadata(stream.metadata)
        except DecodeError as exc:
            log.warning("ignoring a malformed request from %s: %s", stream.peer, exc)
            stream.release()
            return
        try:
            stream.wait(timeout=self.stream_timeout_s)
            prompt = bytes(memoryview(stream.view("prompt")))
        except (TransportError, KeyError) as exc:
            log.warning("request %s from %s failed before its prompt arrived: %s",
                        request.request_id, stream.peer, exc)
            return
        finally:
            stream.release()
        try:
            self._reply(request, prompt)
            self.served += 1
        except LynxError as exc:
            log.warning("request %s failed: %s", request.request_id, exc)
            self._send_error(request, str(exc))

    def _token_ids(self, request: KVRequest, prompt: bytes) -> list[int]:
        if request.kind == "ids":
            if len(prompt) % 4:
                raise DecodeError("an ids prompt must be int32 token ids")
            import numpy as np  # noqa: PLC0415

            return [int(t) for t in np.frombuffer(prompt, dtype="<i4")]
        try:
            text = prompt.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("a text prompt must be UTF-8") from None
        return self.model.chat_prompt(text) if request.kind == "chat" else self.model.tokenize(text)

    def _reply(self, request: KVRequest, prompt: bytes) -> None:
        ids = self._token_ids(request, prompt)
        if self.cache is not None:
            prefill = self.cache.get_or_prefill(self.model, ids).prefill
        else:
            prefill = self.model.prefill(ids)
        t0 = self.clock()
        conn = self._connection(request.reply_to)
        conn.set_link_rate(None if request.bandwidth_gbps is None
                           else Rate(request.bandwidth_gbps, BURST_BYTES))
        codec = CodecConfig(scheme=request.scheme, bits=request.anchor_bits
                            if request.scheme is Scheme.LYNX else CodecConfig().bits)
        sending = send_cache(conn, prefill, self.model.info.model_id, codec,
                             request_id=request.request_id, t0_unix=t0,
                             hold_residual=request.hold_residual)
        try:
            sending.wait(self.stream_timeout_s)
        except TransportError:
            self._drop(request.reply_to)
            raise

    def _send_error(self, request: KVRequest, message: str) -> None:
        try:
            conn = self._connection(request.reply_to)
            # A manifest needs one region: the error travels as a one-byte stream.
            conn.send_stream([("error", b"\0", int(Lane.ANCHOR))],
                             metadata=error_reply(request.request_id, message)).wait(10.0)
        except TransportError as exc:
            log.warning("could not tell %s:%d that request %s failed: %s",
                        *request.reply_to, request.request_id, exc)
            self._drop(request.reply_to)

    def _connection(self, address: tuple[str, int]) -> Connection:
        conn = self._conns.get(address)
        if conn is not None and conn.broken is None:
            return conn
        self._drop(address)
        conn = connect(address, timeout=10.0, config=self.config)
        self._conns[address] = conn
        return conn

    def _drop(self, address: tuple[str, int]) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)
        self._receiver.close()

    def __enter__(self) -> PrefillNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
