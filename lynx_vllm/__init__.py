"""lynx_vllm: Lynx inside vLLM. A KV connector (``LynxConnector``) for vLLM's
disaggregated prefill: the producer instance streams each request's prompt KV
cache over :mod:`lynx_transport`, encoded by the Lynx codec (anchor lane first),
and the consumer instance's Lynx threads write it layer by layer into its paged
blocks as it lands (:mod:`~lynx_vllm.load_threads`), while its first forward pass
runs and waits for each layer (``"load": "sync"``, the default), or while vLLM runs
other requests (``"load": "async"``).

Use it from vLLM (the optional ``vllm`` extra)::

    KVTransferConfig(kv_connector="LynxConnector",
                     kv_connector_module_path="lynx_vllm.connector",
                     kv_role="kv_producer",   # or "kv_consumer"
                     kv_connector_extra_config={"port": 14600, "scheme": "lynx"})

Layers (one way): :mod:`lynx_vllm.connector` (the only module that imports
vLLM) -> :mod:`~lynx_vllm.plan` (scheduler-side bookkeeping, plain values),
:mod:`~lynx_vllm.paged` (vLLM's paged block layout), :mod:`~lynx_vllm.producer`,
:mod:`~lynx_vllm.load_threads` and :mod:`~lynx_vllm.consumer` (the two ends, on
:mod:`lynx_decode` and :mod:`lynx_transport`) -> :mod:`~lynx_vllm.config`. Importing this package
imports neither vLLM nor torch; nothing else in Lynx imports it.
"""

from lynx_vllm.config import ConnectorConfig
from lynx_vllm.errors import ConnectorError

__all__ = ["ConnectorConfig", "ConnectorError"]
