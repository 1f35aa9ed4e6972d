"""The producer's end: prefills vLLM computed, held in their native precision
until a consumer pulls them, and served by a Lynx :class:`~lynx_decode.PrefillNode`.

vLLM's worker hands each request's K/V to :meth:`HeldPrefills.save_layer` layer
by layer as its last prefill step runs (copied out of the paged blocks, so vLLM
can free them at once), and :meth:`HeldPrefills.finish` publishes the prefill.
Each saved layer is also encoded at once into the forms in ``prepare`` (the
scheme the connector is configured for; INT8 and the LYNX splits for ``auto``),
on a thread beside vLLM's (:class:`~lynx_decode.kvencode.EncodeAhead`), while
vLLM computes the next layer: a pull of a prepared form starts sending at once,
and only a pull of another form (a request that asks for a scheme of its own)
is encoded when it comes, from the float32 cache held beside the forms.
A consumer's pull request (a :class:`~lynx_decode.request.KVRequest` carrying
the prompt's token ids and the scheme it wants) reaches the prefill node, which
asks :meth:`HeldPrefills.prefill` for those ids and encodes and streams the cache
the usual Lynx way: anchors first, layer by layer, through the node's one
egress (one send scheduler and one link rate for every consumer, so a new
request's anchors go before older residuals).

The clock a consumer's ``t0`` starts on is the prefill node's: the moment the
cache is held (here: pulled from the store), as in every Lynx run.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lynx_decode.codec.config import CodecConfig
from lynx_decode.errors import DecodeError
from lynx_decode.kvencode import EncodeAhead, EncodedCache
from lynx_decode.model.buffers import KVBuffers, KVShape
from lynx_decode.model.protocol import LMCache, ModelInfo, Prefill

__all__ = ["HeldPrefills"]

log = logging.getLogger("lynx_vllm")


class _Saving:
    def __init__(self, ids: tuple[int, ...], kv: KVBuffers, ahead: EncodeAhead, started: float,
                 name: str) -> None:
        self.ids = ids
        self.kv = kv
        self.ahead = ahead
        self.started = started
        self.name = name
        self.done = threading.Event()
        self.held: _Held | None = None


@dataclasses.dataclass
class _Held:
    prefill: Prefill
    encoded: dict[CodecConfig, EncodedCache]
    name: str
    used_at: float  # published, or last pulled
    pulls: int = 0

    @property
    def nbytes(self) -> int:
        kv = self.prefill.kv
        return kv.keys.nbytes + kv.values.nbytes + sum(e.nbytes for e in self.encoded.values())


class HeldPrefills:
    """The producer's held prefills, keyed by prompt token ids; a
    :class:`~lynx_decode.model.protocol.CausalLM` for :class:`~lynx_decode.PrefillNode` whose
    ``prefill`` finds the cache vLLM computed (it never runs a model itself).

    ``max_prefills``: prefills held (past it the least recently used one is dropped).
    ``hold_s``: a held prefill no consumer pulled for this long (since it was published or last
    pulled) is dropped by :meth:`expire` (which every publish and pull runs too).
    ``wait_s``: how long a pull for a prefill still being saved waits for it.
    ``prepare``: the forms each layer is encoded into as it is saved (none: every pull encodes).
    ``clock``: monotonic seconds (the tests' virtual clock). Every drop is logged on ``lynx_vllm``:
    a WARNING for a prefill no consumer ever pulled (a hand-off that did not happen), else INFO.
    Thread-safe: vLLM's worker saves while the prefill node's thread pulls.
    """

    def __init__(self, info: ModelInfo, *, max_prefills: int = 16, hold_s: float = 60.0, wait_s: float = 30.0,
                 prepare: Sequence[CodecConfig] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self._info = info
        self.prepare = tuple(prepare)
        self._encoder = cf.ThreadPoolExecutor(1, thread_name_prefix="lynx-encode-ahead")
        self._max = max_prefills
        self._hold_s = hold_s
        self._wait_s = wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[tuple[int, ...], _Held] = collections.OrderedDict()
        self._saving: dict[tuple[int, ...], _Saving] = {}

    @property
    def info(self) -> ModelInfo:
        return self._info

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def held_bytes(self) -> int:
        """Bytes of every held prefill: the float32 cache and its prepared forms."""
        with self._lock:
            return sum(held.nbytes for held in self._held.values())

    def close(self) -> None:
        """Stop the encoding thread (saves after this fail)."""
        self._encoder.shutdown(wait=False, cancel_futures=True)

    # -- the worker's side (vLLM's save_kv_layer / wait_for_save) ---------------------------------
    def begin(self, prompt_ids: Sequence[int], name: str | None = None) -> None:
        """Start saving the cache of ``prompt_ids[:-1]`` (every layer must follow, then :meth:`finish`);
        ``name``: the request's, for the log."""
        ids = tuple(int(t) for t in prompt_ids)
        if len(ids) < 2:
            raise DecodeError(f"a prompt of {len(ids)} token(s) has no cache to hold")
        info = self._info
        kv = KVBuffers(KVShape(info.num_layers, info.kv_heads, len(ids) - 1, info.head_dim))
        ahead = EncodeAhead(ids, info.layers, self.prepare, self._encoder)
        with self._lock:
            self._saving[ids] = _Saving(ids, kv, ahead, self._clock(), f"request {name}" if name else "a request")

    def save_layer(self, prompt_ids: Sequence[int], layer: int, k: Any, v: Any) -> None:
        """Layer ``layer``'s K and V (``[kv_heads, len(prompt_ids) - 1, head_dim]``, any float dtype),
        queued for encoding into the prepared forms at once."""
        saving = self._saving_of(prompt_ids)
        saving.kv.write_layer(layer, np.asarray(k, dtype=np.float32), np.asarray(v, dtype=np.float32))
        if saving.ahead.configs:
            saving.ahead.layer(layer, *saving.kv.layer(layer))

    def finish(self, prompt_ids: Sequence[int]) -> Prefill:
        """Publish the saved prefill (every layer written): pulls for it are served from now on."""
        ids = tuple(int(t) for t in prompt_ids)
        with self._lock:
            saving = self._saving.pop(ids, None)
        if saving is None:
            raise DecodeError("finish() without begin() for this prompt")
        missing = saving.kv.missing_layers()
        if missing:
            saving.ahead.cancel()
            saving.done.set()
            raise DecodeError(f"the prefill of {len(ids)} tokens is missing layers {missing}")
        try:
            encoded = saving.ahead.finish() if saving.ahead.configs else {}
        except BaseException:
            saving.done.set()
            raise
        now = self._clock()
        prefill = Prefill(ids, saving.kv, now - saving.started)
        held = _Held(prefill, encoded, saving.name, now)
        dropped: list[tuple[_Held, str]] = []
        with self._lock:
            self._held[ids] = held
            self._held.move_to_end(ids)
            while len(self._held) > self._max:
                dropped.append((self._held.popitem(last=False)[1], "max"))
            dropped += self._expired(now)
        saving.held = held
        saving.done.set()
        self._log_drops(dropped)
        return prefill

    def expire(self) -> int:
        """Drop the held prefills no consumer pulled for ``hold_s``; how many were dropped."""
        with self._lock:
            dropped = self._expired(self._clock())
        self._log_drops(dropped)
        return len(dropped)

    def _expired(self, now: float) -> list[tuple[_Held, str]]:  # under the lock
        stale = [ids for ids, held in self._held.items() if now - held.used_at >= self._hold_s]
        return [(self._held.pop(ids), "hold") for ids in stale]

    def _log_drops(self, dropped: list[tuple[_Held, str]]) -> None:
        for held, why in dropped:
            tokens = len(held.prefill.token_ids)
            pulled = "no consumer pulled it" if held.pulls == 0 else f"pulled {held.pulls} time(s)"
            since = "published" if held.pulls == 0 else "last pulled"
            because = (f"held for hold_s={self._hold_s:g} s since it was {since}" if why == "hold"
                       else f"max_prefills={self._max} more recently used prefills are held")
            log.log(logging.WARNING if held.pulls == 0 else logging.INFO,
                    "dropped the held cache of %s (%d prompt tokens, %s): %s", held.name, tokens, pulled,
                    because)

    def abort(self, prompt_ids: Sequence[int]) -> None:
        """Forget a save that will not finish (the request was preempted or aborted)."""
        with self._lock:
            saving = self._saving.pop(tuple(int(t) for t in prompt_ids), None)
        if saving is not None:
            saving.ahead.cancel()
            saving.done.set()

    def _saving_of(self, prompt_ids: Sequence[int]) -> _Saving:
        with self._lock:
            saving = self._saving.get(tuple(int(t) for t in prompt_ids))
        if saving is None:
            raise DecodeError("save_layer() without begin() for this prompt")
        return saving

    # -- the prefill node's side ---------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> Prefill:
        """The held prefill of ``token_ids`` (waiting up to ``wait_s`` for one still being saved), or
        :class:`DecodeError` saying it is not held."""
        return self._pull(token_ids).prefill

    def encoded(self, token_ids: Sequence[int], config: CodecConfig) -> EncodedCache | None:
        """The held prefill of ``token_ids`` encoded as ``config`` when that form was prepared, else
        None (then the prefill node encodes it from :meth:`prefill`); :class:`DecodeError` as there."""
        return self._pull(token_ids, config).encoded.get(config)

    def _pull(self, token_ids: Sequence[int], form: CodecConfig | None = None) -> _Held:
        """The held entry, counted as pulled unless ``form`` was asked and is not held (then
        :meth:`prefill` follows and counts it)."""
        ids = tuple(int(t) for t in token_ids)
        while True:
            with self._lock:
                now = self._clock()
                dropped = self._expired(now)
                held = self._held.get(ids)
                if held is not None and (form is None or form in held.encoded):
                    held.pulls += 1
                    held.used_at = now
                    self._held.move_to_end(ids)
                saving = self._saving.get(ids)
            self._log_drops(dropped)
            if held is not None:
                return held
            if saving is None or not saving.done.wait(self._wait_s) or saving.held is None:
                raise DecodeError(f"this producer holds no prefill of the {len(ids)}-token prompt: it was not "
                                  "prefilled here (the producer saves requests whose kv_transfer_params carry "
                                  f"do_remote_decode: true), or was dropped (unpulled for hold_s={self._hold_s:g} s, "
                                  f"or past max_prefills={self._max})")
            # published meanwhile: count the pull on the held entry

    def tokenize(self, text: str) -> list[int]:
        raise DecodeError("the vLLM producer serves token-id prompts only")

    def chat_prompt(self, message: str) -> list[int]:
        raise DecodeError("the vLLM producer serves token-id prompts only")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        raise DecodeError("the vLLM producer has no tokenizer")

    def cache_from(self, kv: KVBuffers, *, wait: Callable[[int], KVBuffers | None] | None = None) -> LMCache:
        raise DecodeError("the vLLM producer does not decode")

    def forward(self, cache: LMCache, token_ids: Sequence[int]) -> np.ndarray:
        raise DecodeError("the vLLM producer does not decode")
