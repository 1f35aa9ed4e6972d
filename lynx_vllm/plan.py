"""The scheduler side's bookkeeping, on plain values (vLLM's objects stay in :mod:`lynx_vllm.connector`).

Cache convention (Lynx's everywhere): a prompt of ``n`` tokens has the cache of
its first ``n - 1``; the consumer loads those (whole blocks and the partial
last one) and computes the last prompt token itself, which gives the first
logits. So a consumer with ``c`` tokens already computed locally (its own
prefix cache) loads tokens ``[c, n - 1)``.

The hand-off between the two instances is vLLM's ``kv_transfer_params``: a request
sent to the producer with ``{"do_remote_decode": true}`` (:data:`REMOTE_DECODE`, what
vLLM's disaggregated proxies send; the producer saves no other request's cache)
finishes with ``{"lynx": {"producer": [host, port], "prompt_tokens": n}}`` (plus
vLLM's ``do_remote_prefill`` convention), and the proxy passes it to the consumer's
request, optionally with ``"scheme"`` and ``"planes"`` inside ``"lynx"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from lynx_decode.codec.config import Scheme
from lynx_vllm.config import Planes

__all__ = ["Transfer", "LoadSpec", "SaveSpec", "ConsumerPlan", "ProducerPlan", "transfer_of", "producer_params",
           "REMOTE_DECODE", "remote_decode"]

#: The ``kv_transfer_params`` of a request sent to a producer for a consumer to decode (vLLM's convention).
REMOTE_DECODE: Mapping[str, bool] = MappingProxyType({"do_remote_decode": True, "do_remote_prefill": False})


def remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's ``kv_transfer_params`` ask the producer to hold its cache for a consumer
    (``do_remote_decode`` true, as in :data:`REMOTE_DECODE`)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Where a request's cache is held: the producer's address and the prompt length it was saved for."""

    producer: tuple[str, int]
    prompt_tokens: int


def transfer_of(params: Mapping[str, Any] | None) -> Transfer | None:
    """The :class:`Transfer` in a request's ``kv_transfer_params``, or None (absent or malformed)."""
    lynx = (params or {}).get("lynx")
    if not isinstance(lynx, Mapping):
        return None
    producer, tokens = lynx.get("producer"), lynx.get("prompt_tokens")
    if not (isinstance(producer, Sequence) and len(producer) == 2 and isinstance(tokens, int)):
        return None
    host, port = producer
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        return None
    return Transfer((host, port), tokens)


def producer_params(address: tuple[str, int], prompt_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer's finished request returns."""
    return {"lynx": {"producer": list(address), "prompt_tokens": prompt_tokens},
            "do_remote_prefill": True, "do_remote_decode": False}


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """One load for the worker: tokens ``[start, end)`` of ``prompt_ids`` into ``block_ids``."""

    request_id: str
    transfer: Transfer
    prompt_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    scheme: Scheme
    planes: Planes
    #: the blocks the load may write (an asynchronous load: the request's blocks no other request
    #: shares, vLLM's unhashed ones), or None (a synchronous load, inside the forward that owns them)
    own_blocks: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class SaveSpec:
    """One save for the worker: the cache of ``prompt_ids[:-1]``, in ``block_ids``."""

    request_id: str
    prompt_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


class ConsumerPlan:
    """Which requests load what: ``matched`` (vLLM's ``get_num_new_matched_tokens``, side-effect free
    apart from remembering the local count), ``allocated`` (``update_state_after_alloc``) and
    ``take`` (``build_connector_meta`` for a synchronous load: the loads of the step's new requests,
    once each; ``update_state_after_alloc`` itself for an asynchronous one, whose request is not
    scheduled until its load is done).

    ``once``: a request loads at most once until :meth:`forget` (asynchronous loads: a request whose
    load failed under ``kv_load_failure_policy=recompute``, or that was preempted, comes back with
    nothing computed and is recomputed locally, not loaded again, as NIXL's connector does)."""

    def __init__(self, *, once: bool = False) -> None:
        self._once = once
        self._local: dict[str, int] = {}
        self._ready: dict[str, tuple[Transfer, int, int]] = {}
        self._taken: set[str] = set()

    def matched(self, request_id: str, params: Mapping[str, Any] | None, prompt_tokens: int,
                num_computed: int) -> int:
        transfer = transfer_of(params)
        if transfer is None or transfer.prompt_tokens != prompt_tokens or request_id in self._taken:
            return 0
        self._local[request_id] = num_computed
        return max(0, prompt_tokens - 1 - num_computed)

    def allocated(self, request_id: str, params: Mapping[str, Any] | None, num_external: int) -> None:
        local = self._local.pop(request_id, None)
        transfer = transfer_of(params)
        if num_external > 0 and transfer is not None and local is not None:
            self._ready[request_id] = (transfer, local, local + num_external)

    def take(self, request_id: str, prompt_ids: Sequence[int], block_ids: Sequence[int],
             scheme: Scheme, planes: Planes, *, own_blocks: Sequence[int] | None = None) -> LoadSpec | None:
        ready = self._ready.pop(request_id, None)
        if ready is None:
            return None
        if self._once:
            self._taken.add(request_id)
        transfer, start, end = ready
        return LoadSpec(request_id, transfer, tuple(prompt_ids), tuple(block_ids), start, end, scheme, planes,
                        None if own_blocks is None else tuple(own_blocks))

    def pending(self) -> int:
        return len(self._ready)

    def forget(self, request_id: str) -> None:
        self._local.pop(request_id, None)
        self._ready.pop(request_id, None)
        self._taken.discard(request_id)


class ProducerPlan:
    """Which requests' caches the producer saves: those whose ``kv_transfer_params`` ask for a remote
    decode (:func:`remote_decode`; any other request is served as by a plain vLLM), each once, in the
    step its prefill completes (chunked prefill included), with every block it has by then."""

    def __init__(self) -> None:
        self._prefilling: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self.saved: set[str] = set()

    def step(self, request_id: str, *, prompt_ids: Sequence[int] | None, new_blocks: Sequence[int],
             num_computed: int, scheduled: int, params: Mapping[str, Any] | None = None) -> SaveSpec | None:
        """One scheduled step of a request: ``prompt_ids`` and its ``kv_transfer_params`` (``params``)
        when it is new (else None), the blocks it gained, the tokens computed before the step and
        scheduled in it. The save, in its last prefill step, if ``params`` ask for a remote decode."""
        if prompt_ids is not None:
            if not remote_decode(params):
                return None  # not for a consumer: never tracked, never saved
            self._prefilling[request_id] = (tuple(prompt_ids), list(new_blocks))
        elif request_id in self._prefilling:
            self._prefilling[request_id][1].extend(new_blocks)
        else:
            return None  # decoding, or already saved
        ids, blocks = self._prefilling[request_id]
        if num_computed + scheduled < len(ids) or len(ids) < 2:
            return None
        del self._prefilling[request_id]
        self.saved.add(request_id)
        return SaveSpec(request_id, ids, tuple(blocks))

    def finished(self, request_id: str) -> bool:
        """Forget the request; True if its cache was saved."""
        self._prefilling.pop(request_id, None)
        if request_id in self.saved:
            self.saved.discard(request_id)
            return True
        return False
