"""Lynx inside vLLM: starting and driving vLLM instances (:mod:`.driver`, :mod:`.nodes`), the connector demo
(``python -m lynx_bench.vllm.demo``) and vLLM's serving benchmark against none / lynx / nixl
(``python -m lynx_bench.vllm.bench``: its server processes :mod:`.bench_servers`, its session :mod:`.bench_session`,
its client :mod:`.bench_client` and summary :mod:`.bench_summary`).
Of lynx_bench, only :mod:`.nodes` and :mod:`.bench_client` import vLLM, deferred, in the vLLM environment
(absolute imports: ``import vllm`` is the top-level vLLM package).
"""
