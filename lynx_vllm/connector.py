"""``LynxConnector``: vLLM's KV connector interface (``KVConnectorBase_V1``) on Lynx.

The only module of Lynx that imports vLLM. vLLM builds one instance in its
scheduler process (role ``SCHEDULER``: the bookkeeping of :mod:`lynx_vllm.plan`)
and one in each worker (role ``WORKER``: a producer's
:class:`~lynx_vllm.producer.HeldPrefills` behind a Lynx prefill node, or a
consumer's :class:`~lynx_vllm.consumer.KVLoader`).

Producer (``kv_producer``): the prompt cache of every request whose
``kv_transfer_params`` carry ``do_remote_decode: true`` (vLLM's disaggregated
convention, :data:`~lynx_vllm.plan.REMOTE_DECODE`; other requests are served as by a
plain vLLM) is copied out of the paged blocks as its last prefill step runs
(``save_kv_layer``, layer by layer), held, and served to consumers that pull it;
the finished request's ``kv_transfer_params`` say where
(:func:`~lynx_vllm.plan.producer_params`). vLLM frees the blocks at once (the
connector holds its own copy); a held cache is dropped once no consumer pulled it
for ``hold_s``, or when ``max_prefills`` more recently used ones are held (logged
either way).

Consumer (``kv_consumer``): a request whose ``kv_transfer_params`` name a producer
loads its first ``n - 1`` prompt tokens. With ``load: "sync"`` (the default) the
load is synchronous in vLLM's terms: the forward pass that computes the last
prompt token starts at once, a Lynx thread writes each layer into the request's
blocks as it lands (:mod:`lynx_vllm.load_threads`), and ``wait_for_layer_load``
waits inside the forward for exactly the layer it needs to be written, so the
transfer, the writes and the forward overlap layer by layer (and the rest of the
batch waits with it). With ``load: "async"``
``get_num_new_matched_tokens`` answers ``(n - 1, True)``: vLLM parks the request,
``start_load_kv`` sends the pull, a Lynx thread writes each layer into the
request's blocks as it lands, ``get_finished``
reports the request once every plane of every layer is in place, and the
request is scheduled then, for its last prompt token; ``wait_for_layer_load``
never waits for it. A load that fails reports the request's blocks through
``get_block_ids_with_load_errors`` (an asynchronous one in the step whose
``get_finished`` reports it): vLLM's ``kv_load_failure_policy`` then fails the
request or recomputes it, and nothing of a failed stream is used.

Without scheduler support vLLM cannot decode on anchors early, so the consumer
waits for every plane of a layer (LYNX is then exactly INT8); the design of that
support is ``docs/vllm_anchor_decoding.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lynx_decode.model.protocol import ModelInfo
from lynx_decode.model.store import directory_model_id
from lynx_decode.prefill_node import PrefillNode
from lynx_transport import Rate
from lynx_vllm import paged
from lynx_vllm.config import ConnectorConfig, LoadMode, prepared_forms
from lynx_vllm.consumer import KVLoader
from lynx_vllm.errors import ConnectorError, LoadError
from lynx_vllm.load_threads import LoadJob, LoadThreads
from lynx_vllm.plan import ConsumerPlan, LoadSpec, ProducerPlan, SaveSpec, producer_params
from lynx_vllm.producer import HeldPrefills

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["LynxConnector", "LynxConnectorMetadata"]

log = logging.getLogger("lynx_vllm")

#: The producer's link burst (as the prefill node's).
BURST_BYTES = 1 << 20


@dataclasses.dataclass
class LynxConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)


def _model_id(vllm_config: VllmConfig) -> str:
    """Names the model's weights and the cache dtype (both instances must agree): a local
    directory by Lynx's directory id (its files' names, sizes and mtimes and its config),
    a hub name as given."""
    model = Path(str(vllm_config.model_config.model))
    name = directory_model_id(model) if model.is_dir() else str(model)
    return f"vllm:{name}:{vllm_config.model_config.dtype}"


def _isa(kv: torch.Tensor, block_size: int, head_size: int) -> str | None:
    """The CPU attention kernel vLLM picks for this cache (None if this vLLM does not say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415 - CPU builds only
    except ImportError:
        return None
    return str(_get_attn_isa(kv.dtype, block_size, head_size))


class LynxConnector(KVConnectorBase_V1):
    """See the module docstring. Settings: ``kv_connector_extra_config``
    (:class:`~lynx_vllm.config.ConnectorConfig`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._producer = bool(transfer.is_kv_producer)
        self._consumer = bool(transfer.is_kv_consumer)
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, producer=self._producer)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._model_id = _model_id(vllm_config)
        self._vllm_config = vllm_config
        self._async = self.config.load is LoadMode.ASYNC
        # scheduler side
        self._consumer_plan = ConsumerPlan(once=self._async)
        self._producer_plan = ProducerPlan()
        self._async_specs: list[LoadSpec] = []  # taken in update_state_after_alloc, sent with the next meta
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._kv_layers: list[torch.Tensor] = []
        self._layout: paged.BlockLayout | None = None  # None: the vec layout
        self._layer_index: dict[str, int] = {}
        self._held: HeldPrefills | None = None
        self._stopped = threading.Event()
        self._expiry: threading.Thread | None = None
        self._node: PrefillNode | None = None
        self._loader: KVLoader | None = None
        self._threads: LoadThreads | None = None
        self._active: list[LoadJob] = []  # this step's synchronous loads
        self._load_errors: set[int] = set()
        log.info("LynxConnector %s (%s) for %s: %s", role.name.lower(), transfer.kv_role, self._model_id, self.config)

    # ==== worker side ==========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = dict(kv_caches)
        self._kv_layers = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        isa = _isa(first, self._block_size, first.shape[3] // 2)
        if isa is not None and isa not in paged.VERIFIED_ISAS:  # measured with vLLM's own cache write
            from vllm import _custom_ops as ops  # noqa: PLC0415 - CPU builds only

            self._layout = paged.probe_layout(
                isa, self._block_size, first.shape[3] // 2, first.dtype,
                lambda key, value, kc, vc, slots: ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa))
            log.info("LynxConnector: vLLM's %r attention kernel's block layout probed", isa)
            if isa == "amx" and not torch.cpu._init_amx():
                # vLLM's AMX attention kernel relies on the process having asked the kernel for the
                # tile state (oneDNN asks, it seems, on its first large GEMM): a decode instance whose first
                # forward is a loaded request's one token never ran one, and died on SIGILL
                raise ConnectorError("vLLM picked its AMX attention kernel, but this process may not use AMX")
        heads, head_size = paged.check_layout(first, block_size=self._block_size, isa=isa, layout=self._layout)
        for name, kv in kv_caches.items():
            if tuple(kv.shape) != tuple(first.shape):
                raise ConnectorError(f"layer {name} has cache shape {tuple(kv.shape)}, the first "
                                     f"{tuple(first.shape)}: LynxConnector needs one shape for every layer")
        mc = self._vllm_config.model_config
        info = ModelInfo(self._model_id, len(kv_caches), heads, head_size, int(mc.max_model_len),
                         int(mc.get_vocab_size()), frozenset())
        timeouts = self.config.timeouts()
        if self._producer:
            self._held = HeldPrefills(info, max_prefills=self.config.max_prefills, hold_s=self.config.hold_s,
                                      wait_s=self.config.timeout_s,
                                      prepare=prepared_forms(self.config.scheme, self.config.planes))
            self._expiry = threading.Thread(target=self._expire_held, args=(self._held,),
                                            name="lynx-held-expiry", daemon=True)
            self._expiry.start()
            rate = None if self.config.bandwidth_gbps is None else Rate(self.config.bandwidth_gbps, BURST_BYTES)
            self._node = PrefillNode(self._held, host=self.config.host, port=self.config.port, timeouts=timeouts,
                                     config=self.config.transport_config(), memory_cache=0, link_rate=rate)
            log.info("LynxConnector producer serving %s:%d (link %s)", *self._node.address,
                     "unshaped" if rate is None else f"{self.config.bandwidth_gbps:g} Gbit/s")
        if self._consumer:
            # a kv_both instance's receiver takes any free port: the fixed one is its prefill node's
            own = dataclasses.replace(self.config, port=0 if self._producer else self.config.port)
            self._loader = KVLoader(info, own)
            self._threads = LoadThreads(self._loader, len(kv_caches), self._write_layer)
            log.info("LynxConnector consumer receiving on %s:%d (%s loads)", *self._loader.address,
                     self.config.load.value)

    def _expire_held(self, held: HeldPrefills) -> None:
        """The producer's expiry thread: a held prefill is dropped within a quarter of ``hold_s``
        (at most 5 s) of its time, even while no request comes."""
        interval = min(self.config.hold_s / 4, 5.0)
        while not self._stopped.wait(interval):
            held.expire()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LynxConnectorMetadata)
        if not meta.loads:
            return
        if self._threads is None:
            raise ConnectorError("a load was scheduled on an instance that is not a kv_consumer")
        for spec in meta.loads:  # the pull goes now; a Lynx thread writes the layers as they land
            if self._async:
                self._threads.submit(spec)
            else:
                self._active.append(self._threads.start(spec))

    def _write_layer(self, spec: LoadSpec, index: int, k: Any, v: Any) -> None:
        """A load thread's write: layer ``index`` into the request's blocks (an asynchronous load's own
        blocks only, ``spec.own_blocks``), in inference mode as vLLM's forward writes (torch's mode is
        per thread)."""
        with torch.inference_mode():
            paged.scatter(self._kv_layers[index], spec.block_ids, spec.start, k[:, spec.start : spec.end],
                          v[:, spec.start : spec.end], allowed=spec.own_blocks, layout=self._layout)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads whose cache is in place (every plane of every layer written), or that
        failed or were cancelled: their request ids as finished receiving, the failed ones' blocks
        queued for this same step's ``get_block_ids_with_load_errors``."""
        if not self._async or self._threads is None:
            return None, None
        ended, failed = self._threads.collect(finished_req_ids)
        for spec in failed:
            self._fail_blocks(spec)
        return None, ended or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._active:  # asynchronous loads never wait here
            return
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        assert self._threads is not None
        for job in self._active:
            if index == 0:
                job.load.times.setdefault("forward_started_at", time.time())
            # False: the pull or a layer failed, and _finish_loads reports the load's blocks
            self._threads.wait_written(job, index)
        if index == len(self._layer_index) - 1:
            self._finish_loads()

    def _fail_blocks(self, spec: LoadSpec) -> None:
        first, last = spec.start // self._block_size, (spec.end - 1) // self._block_size
        self._load_errors.update(spec.block_ids[first : last + 1])

    def _finish_loads(self) -> None:
        """End the step's loads (after the last layer, or in wait_for_save if the forward stopped short):
        a load short of a layer fails, and every failed load's blocks go to vLLM."""
        assert self._loader is not None and self._threads is not None
        for job in self._active:
            self._threads.end(job)  # its thread is out: nothing of it writes after this
            spec, load = job.spec, job.load
            if not load.failed and load.layers_loaded < len(self._layer_index):
                self._loader.fail(load, LoadError(f"only {load.layers_loaded} of {len(self._layer_index)} "
                                                   "layers were loaded in the step"))
            if load.failed:  # whatever failed and whenever: vLLM hears of every block of it
                self._fail_blocks(spec)
            self._loader.finish(load)
        self._active = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LynxConnectorMetadata)
        if not meta.saves or self._held is None:
            return
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        for spec in meta.saves:
            try:
                if index == 0:
                    self._held.begin(spec.prompt_ids, spec.request_id)
                k, v = paged.gather(kv_layer, spec.block_ids, 0, len(spec.prompt_ids) - 1, self._layout)
                self._held.save_layer(spec.prompt_ids, index, paged.to_float32(k), paged.to_float32(v))
            except Exception as exc:  # noqa: BLE001 - a failed save loses that request's hand-off only
                log.warning("could not save layer %d of request %s: %s", index, spec.request_id, exc)
                self._held.abort(spec.prompt_ids)

    def wait_for_save(self) -> None:
        if self._active:  # a step whose forward never reached the last layer
            self._finish_loads()
        meta = self._connector_metadata
        if not isinstance(meta, LynxConnectorMetadata) or not meta.saves or self._held is None:
            return
        for spec in meta.saves:
            try:
                prefill = self._held.finish(spec.prompt_ids)
            except Exception as exc:  # noqa: BLE001 - logged; a consumer's pull is refused with the reason
                log.warning("request %s's cache is not held: %s", spec.request_id, exc)
                continue
            log.info("holding %s's cache: %d tokens x %d layers", spec.request_id, prefill.cached_tokens,
                     len(self._layer_index))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._stopped.set()
        if self._threads is not None:
            self._threads.close()
            self._threads = None
        if self._expiry is not None:
            self._expiry.join(1.0)
            self._expiry = None
        if self._node is not None:
            self._node.close()
            self._node = None
        if self._held is not None:
            self._held.close()
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    # ==== scheduler side =======================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._consumer:
            return 0, False
        n = self._consumer_plan.matched(request.request_id, request.kv_transfer_params,
                                        int(request.num_prompt_tokens), num_computed_tokens)
        return n, self._async and n > 0

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group: a load writes the request's own blocks, all of them."""
        config = self._kv_cache_config
        if config is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return tuple(config.transfer_group_ids)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if not self._consumer:
            return
        params = request.kv_transfer_params
        self._consumer_plan.allocated(request.request_id, params, num_external_tokens)
        if self._async and num_external_tokens > 0:
            # the request waits (WAITING_FOR_REMOTE_KVS) and is not in this step's new requests:
            # its load goes with this step's metadata, into blocks only it holds (vLLM's unhashed ones)
            scheme, planes = self.config.request_codec(params)
            spec = self._consumer_plan.take(request.request_id, list(request.prompt_token_ids or []),
                                            blocks.get_block_ids()[0], scheme, planes,
                                            own_blocks=blocks.get_unhashed_block_ids_all_groups()[0])
            if spec is not None:
                self._async_specs.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LynxConnectorMetadata(loads=self._async_specs)
        self._async_specs = []
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            ids = list(req.prompt_token_ids or [])
            blocks = list(req.block_ids[0]) if req.block_ids else []
            params = (getattr(req.sampling_params, "extra_args", None) or {}).get("kv_transfer_params")
            if self._consumer:
                scheme, planes = self.config.request_codec(params)
                spec = self._consumer_plan.take(req.req_id, ids, blocks, scheme, planes)
                if spec is not None:
                    meta.loads.append(spec)
            if self._producer:
                save = self._producer_plan.step(req.req_id, prompt_ids=ids, new_blocks=blocks,
                                                num_computed=int(req.num_computed_tokens),
                                                scheduled=int(scheduled.get(req.req_id, 0)), params=params)
                if save is not None:
                    meta.saves.append(save)
        if self._producer:
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                new_blocks = cached.new_block_ids[i]
                save = self._producer_plan.step(req_id, prompt_ids=None,
                                                new_blocks=list(new_blocks[0]) if new_blocks else [],
                                                num_computed=int(cached.num_computed_tokens[i]),
                                                scheduled=int(scheduled.get(req_id, 0)))
                if save is not None:
                    meta.saves.append(save)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._consumer_plan.forget(request.request_id)
        if self._producer and self._producer_plan.finished(request.request_id):
            return False, producer_params((self.config.host, self.config.port), int(request.num_prompt_tokens))
        return False, None
