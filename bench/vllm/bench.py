"""``make vllm-bench``: vLLM's own serving benchmark (``vllm bench serve``, through
:mod:`lynx_bench.vllm.bench_client`) against disaggregated configurations, from the vLLM
environment (``make vllm-env``)::

    python -m lynx_bench.vllm.bench --out vllm-bench-out [--prompt-tokens 2048] [--requests 20]
        [--rate R|auto] [--configs none,lynx-bf16,lynx-int8,lynx-lynx,nixl] [--links unshaped]

Configurations (every server a ``vllm.entrypoints.openai.api_server`` process, one thread):
``none``, one plain vLLM server; ``lynx-<scheme>[-async]``, a LynxConnector producer and
consumer with Lynx's proxy (``python -m lynx_vllm.proxy --scheme <scheme>``) in front (the
configurations of one load mode share the two servers; only the proxy is restarted);
``nixl``, vLLM's NixlConnector (``kv_both``, CPU buffers, :data:`NIXL_EXTRA`, UCX as
:func:`nixl_env` sets it) pair behind the same proxy, which follows vLLM's
P/D convention (the prefill leg gets ``do_remote_decode: true``, the decode leg the prefill
answer's ``kv_transfer_params`` as they came), when ``import nixl`` works in the vLLM environment
(``make vllm-env`` installs ``nixl``); otherwise its row records the exact error and the run
goes on.

Links: ``unshaped`` (loopback, every process in this namespace), or a rate in Gbit/s: a
``lynx link up --hosts 2`` link (prefix ``lynxvb``) at that rate, the producer in its ``tx``
namespace, the consumer in ``rx0``, the proxy and the benchmark client in ``rx1`` (the bridge
reaches both; this process's own requests go from a thread inside ``rx1``), UCX pinned to tcp on
each namespace's veth, and Lynx's own shaper off: Lynx and NIXL cross the same tc-shaped link. The
link is torn down after its runs, on errors and on Ctrl-C. ``none`` (no transfer) runs once,
unshaped. Each row of ``summary.json`` says how its link was shaped (``link_shaping``).

The workload is vLLM's ``random`` dataset: seeded prompts of ``--prompt-tokens`` tokens, 16
output tokens (greedy, EOS ignored), Poisson arrivals at ``--rate``, ``--requests`` requests.
``--rate auto`` is 0.7 x the producer's prefill throughput, from one prefill of the prompt length
(``max_tokens`` 1) timed on the first producer before the runs (with ``auto`` the P/D
configurations run before ``none``; with ``none`` alone, on its plain server).

Writes ``OUT/summary.json`` (:mod:`lynx_bench.vllm.bench_summary`), ``OUT/breakdown.json``
(where each run's TTFT goes, its request throughput and the load averages), ``OUT/ttft.png``,
each run's vLLM result and the proxy's and the consumer's records under ``OUT/runs``, and every
server's log under ``OUT/logs``; prints a table, and one progress line per phase on stderr.
Every wait is bounded; every process (each in a session of its own) is ended on exit, an error,
SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import datetime
import importlib.util
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar, TypeVar

from lynx_bench.common.errors import LinkError, VllmNodeError
from lynx_bench.netem.config import LinkConfig
from lynx_bench.netem.link import Link, teardown
from lynx_bench.vllm.bench_summary import (
    BenchConfig,
    Connector,
    auto_rate,
    failed_row,
    fill_equal_to_int8,
    parse_configs,
    parse_links,
    parse_rate,
    plot_ttft,
    rate_rule,
    run_row,
    table,
    ttft_breakdown,
)
from lynx_bench.vllm.driver import INSTALL_HINT, REPO_ROOT, free_port, numba_cache_env, vllm_python

__all__ = ["main", "run"]

ROOT = REPO_ROOT
MODEL_NAME = "smollm2"
OUTPUT_TOKENS = 16
DEFAULT_CONFIGS = "none,lynx-bf16,lynx-int8,lynx-lynx,nixl"
READY_S = 600.0      # two vLLM servers starting at once on two busy cores
REQUEST_S = 300.0    # one warm-up or measuring request
PROXY_TIMEOUT_S = 300.0
STOP_S = 20.0
LINK_PREFIX = "lynxvb"
#: NixlConnector's ``kv_connector_extra_config``: vLLM's defaults made explicit (the UCX backend,
#: 4 UCX threads; 1 was slower over tcp here, see docs/design.md).
NIXL_EXTRA: dict[str, Any] = {"backends": ["UCX"], "num_threads": 4}

_T = TypeVar("_T")


def nixl_env(side_channel_host: str, side_channel_port: int, ucx: dict[str, str] | None) -> dict[str, str]:
    """A NixlConnector server's environment: its handshake listener (``VLLM_NIXL_SIDE_CHANNEL_*``)
    and, on a namespace link, ``ucx`` (its ``Link.ucx_env``: tcp only, on the host's veth, so the KV
    bytes cross the shaped link and never shared memory). Unshaped (``ucx`` None) UCX picks its own
    transports, shared memory on one machine, as it does for Lynx's ucxx there."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            **(ucx or {})}


def say(message: str) -> None:
    """One progress line on stderr."""
    print(f"vllm-bench {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


class Server:
    """One server process in a session of its own (stopping it ends vLLM's engine core too)."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict[str, str], host: str = "127.0.0.1",
                 caller: Caller | None = None) -> None:
        self.name, self.port, self.log, self.host = name, port, log, host
        self.caller = caller or Caller(None)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self._out.write(f"$ {shlex.join(argv)}\n".encode())
        self._out.flush()
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ready(self) -> bool:
        """Whether ``/health`` answers 200; :class:`VllmNodeError` with its log if the process died."""
        import httpx  # noqa: PLC0415 - the vLLM environment has it

        if self.proc.poll() is not None:
            raise VllmNodeError(f"{self.name} exited with {self.proc.returncode}; the end of its log "
                                f"({self.log}):\n{self.tail()}")
        try:
            return self.caller(lambda: httpx.get(f"{self.url}/health", timeout=5.0, trust_env=False).status_code == 200)
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM to the session, up to ``STOP_S`` to end, then SIGKILL to what is left of it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        self._out.close()


def wait_ready(servers: Sequence[Server], timeout_s: float = READY_S) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        waiting = [s for s in waiting if not s.ready()]
        if waiting and time.monotonic() > deadline:
            raise VllmNodeError(f"not ready within {timeout_s:.0f} s: {[s.name for s in waiting]}; "
                                + "; ".join(f"{s.name}'s log:\n{s.tail()}" for s in waiting))
        if waiting:
            time.sleep(1.0)  # between /health probes


def _enter_namespace(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace`` (``setns(2)`` affects one thread)."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Caller:
    """Runs this process's HTTP calls where the servers can be reached: here (``namespace`` None),
    or on one thread that lives inside ``namespace`` (``close`` ends it)."""

    def __init__(self, namespace: str | None) -> None:
        self.namespace = namespace
        self._pool = (None if namespace is None else concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"netns-{namespace}", initializer=_enter_namespace, initargs=(namespace,)))

    def __call__(self, fn: Callable[[], _T]) -> _T:
        return fn() if self._pool is None else self._pool.submit(fn).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Hosts:
    """Where one link's processes run: all here on loopback (``link`` None), or the producer in a
    ``lynx link up --hosts 2`` link's ``tx`` namespace, the consumer in ``rx0``, and the proxy, the
    benchmark client and this process's requests (:class:`Caller`) in ``rx1``."""

    ROLES: ClassVar[dict[str, str]] = {"producer": "tx", "consumer": "rx0", "client": "rx1"}

    def __init__(self, link: Link | None) -> None:
        self.link = link
        self.caller = Caller(None if link is None else link.namespace("rx1"))

    def argv(self, role: str, argv: list[str]) -> list[str]:
        return argv if self.link is None else self.link.exec_argv(self.ROLES[role], argv)

    def address(self, role: str) -> str:
        return "127.0.0.1" if self.link is None else self.link.address(self.ROLES[role])

    def ucx_env(self, role: str) -> dict[str, str] | None:
        """UCX pinned to tcp on the role's veth; None on loopback."""
        return None if self.link is None else self.link.ucx_env(self.ROLES[role])

    def close(self) -> None:
        self.caller.close()


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
        self.max_model_len = max(4096, args.prompt_tokens + OUTPUT_TOKENS + 128)
        self.hosts = Hosts(None)

    # -- processes ---------------------------------------------------------------------------
    def start(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
              role: str = "producer") -> Server:
        """Start ``argv`` where ``role`` runs (:class:`Hosts`); it listens on that host's ``port``."""
        server = Server(name, self.hosts.argv(role, argv), port, self.logs / f"{name}.log",
                        {**self.env, **(env or {})}, self.hosts.address(role), self.hosts.caller)
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
                "--dtype", "bfloat16",
                "--max-model-len", str(self.max_model_len), "--enforce-eager", "--no-enable-prefix-caching",
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

    def benchmark(self, url: str, align_url: str, rate: float, prefix: str, run_dir: Path) -> dict[str, Any]:
        """vLLM's benchmark against ``url``; its saved result (per-request texts included)."""
        a = self.args
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = [str(self.python), "-m", "lynx_bench.vllm.bench_client", "--backend", "openai", "--base-url", url,
                "--endpoint", "/v1/completions", "--model", str(a.model), "--served-model-name", MODEL_NAME,
                "--tokenizer", str(a.model), "--dataset-name", "random", "--random-input-len", str(a.prompt_tokens),
                "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0", "--num-prompts",
                str(a.requests), "--request-rate", f"{rate:.6g}", "--burstiness", "1", "--seed", str(a.seed),
                "--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(run_dir),
                "--result-filename", "bench.json", "--request-id-prefix", prefix, "--disable-tqdm",
                "--align-url", align_url]
        argv = self.hosts.argv("client", argv)
        bound = 2 * a.requests / rate + 900.0
        log = run_dir / "bench.log"
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
        result_path = run_dir / "bench.json"
        if not result_path.is_file():
            raise VllmNodeError(f"the benchmark exited with {rc} and saved no result (log {log}):\n{tail}")
        return dict(json.loads(result_path.read_text()))


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _link_name(link: float | None) -> str:
    return "unshaped" if link is None else f"{link:g}G"


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


def _groups(configs: Sequence[BenchConfig], *, producer_first: bool) -> list[list[BenchConfig]]:
    """The configurations by the servers they need, in order of first appearance (``producer_first``:
    those with a producer before ``none``, so ``--rate auto`` times a producer's prefill)."""
    out: dict[tuple[Connector, str | None], list[BenchConfig]] = {}
    for c in configs:
        out.setdefault(c.backend, []).append(c)
    groups = list(out.values())
    if producer_first:
        groups.sort(key=lambda g: g[0].connector is Connector.NONE)
    return groups


class _Rate:
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


def _backend(bench: Bench, group: list[BenchConfig], link: float | None, tag: str) -> tuple[Server, Server | None]:
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
        extra: dict[str, Any] = {"host": hosts.address("producer"), "port": free_port()}
        transfer: dict[str, Any] = {"kv_connector": "LynxConnector",
                                    "kv_connector_module_path": "lynx_vllm.connector",
                                    "kv_load_failure_policy": "fail"}
        producer = bench.vllm(f"{tag}-producer", {**transfer, "kv_role": "kv_producer",
                                                  "kv_connector_extra_config": extra},
                              hosts.ucx_env("producer"), "producer")
        loads = bench.out / "runs" / f"{tag}-consumer-loads.jsonl"
        consumer = bench.vllm(f"{tag}-consumer", {**transfer, "kv_role": "kv_consumer", "kv_connector_extra_config":
                                                  {"host": hosts.address("consumer"), "stats_path": str(loads),
                                                   "load": first.load}},
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
def _placed(bench: Bench, link: float | None) -> Iterator[None]:
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); the summary it wrote."""
    python = vllm_python() or Path(sys.executable)
    if importlib.util.find_spec("vllm") is None and vllm_python() is None:
        raise VllmNodeError(f"no vLLM environment: {INSTALL_HINT}")
    out: Path = args.out
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not (out / ".gitignore").exists():  # results, not sources (as pytest's and ruff's caches do)
        (out / ".gitignore").write_text("*\n")
    bench = Bench(args, python)
    rate = _Rate(args.rate)
    rows: list[dict[str, Any]] = []
    texts: list[list[str | None] | None] = []
    errors: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    loadavg_start = os.getloadavg()
    nixl_why = nixl_error(python) if any(c.connector is Connector.NIXL for c in args.configs) else None

    def skip(group: Sequence[BenchConfig], link: float | None, why: str) -> None:
        for c in group:
            say(f"{c.name} @ {_link_name(link)}: not run: {why}")
            rows.append(failed_row(c, link, rate.value, args.requests))
            texts.append(None)
            errors.append({"config": c.name, "link_gbps": link, "error": why})

    try:
        for i, link in enumerate(args.links):
            for group in _groups(args.configs, producer_first=args.rate is None):
                connector = group[0].connector
                if connector is Connector.NONE and i > 0:
                    continue  # no transfer: one run, unshaped
                row_link = None if connector is Connector.NONE else link
                if connector is Connector.NIXL and nixl_why is not None:
                    skip(group, row_link, nixl_why)
                    continue
                tag = f"{group[0].connector.value}{'-async' if group[0].load == 'async' else ''}-{_link_name(row_link)}"
                done = 0
                try:
                    with _placed(bench, row_link):
                        prefill, consumer = _backend(bench, group, row_link, tag)
                        say(f"{tag}: warm-up on {prefill.name}")
                        bench.complete(prefill.url, bench.prompt_ids(64, 7), 2, f"warmup.{tag}")
                        request_rate = rate.ensure(bench, prefill)
                        for c in group:
                            name = f"{c.name}-{_link_name(row_link)}"
                            run_dir = out / "runs" / name
                            run_dir.mkdir(parents=True, exist_ok=True)
                            proxy = None
                            stats = run_dir / "proxy-requests.jsonl"
                            stats.unlink(missing_ok=True)
                            endpoint, align = prefill, prefill
                            if consumer is not None:
                                proxy = bench.proxy(f"{name}-proxy", prefill, consumer, c.scheme, stats)
                                wait_ready([proxy, prefill, consumer], 120.0)  # a dead server: its log at once
                                endpoint, align = proxy, consumer
                            say(f"{name}: warm-up through {endpoint.name} (2 short requests)")
                            for k in range(2):
                                bench.complete(endpoint.url, bench.prompt_ids(64 + k, 11 + k), 2, f"warmup.{name}.{k}")
                            prefix = f"{name}-"
                            say(f"{name}: vllm bench serve, {args.requests} requests of {args.prompt_tokens} tokens at "
                                f"{request_rate:.4f}/s (Poisson, seed {args.seed})")
                            before = os.getloadavg()
                            started = time.monotonic()
                            result = bench.benchmark(endpoint.url, align.url, request_rate, prefix, run_dir)
                            records = _records(stats) if proxy is not None else None
                            loads = _records(out / "runs" / f"{tag}-consumer-loads.jsonl")
                            row = run_row(c, row_link, request_rate, args.requests, result, records, prefix)
                            rows.append(row)
                            errs = result.get("errors") or []
                            texts.append([None if (k < len(errs) and errs[k]) else t
                                          for k, t in enumerate(result.get("generated_texts") or [])])
                            details[name] = {"duration_s": result.get("duration"),
                                             "request_throughput": result.get("request_throughput"),
                                             "wall_s": time.monotonic() - started, "loadavg_before": before,
                                             "loadavg_after": os.getloadavg(),
                                             "errors": sorted({str(e)[:300] for e in errs if e}),
                                             "ttft_breakdown_ms": ttft_breakdown(records or [], loads, prefix)}
                            done += 1
                            for server in (prefill, consumer):  # one that died mid-run says why in the summary
                                if server is not None and server.proc.poll() is not None:
                                    errors.append({"config": c.name, "link_gbps": row_link,
                                                   "error": f"{server.name} exited with {server.proc.returncode} "
                                                            f"during the run; the end of its log ({server.log}):\n"
                                                            f"{server.tail(8)}"})
                            say(f"{name}: {row['completed']} completed, {row['failed']} failed, TTFT p50 "
                                f"{row['ttft_ms']['median'] or 0:.0f} ms")
                            if proxy is not None:
                                bench.stop(proxy)
                except (VllmNodeError, LinkError) as exc:
                    say(f"{tag}: failed: {exc}")
                    skip(group[done:], row_link, str(exc))
                finally:
                    bench.close()
    finally:
        bench.close()
    fill_equal_to_int8(rows, texts)
    summary = {"config": {"command": shlex.join([sys.executable, "-m", "lynx_bench.vllm.bench", *args.argv]),
                          "seed": args.seed, "prompt_tokens": args.prompt_tokens, "output_tokens": OUTPUT_TOKENS,
                          "requests": args.requests, "rate": rate.value,
                          "rate_rule": rate_rule(args.rate, rate.prefill_s, args.prompt_tokens, rate.measured_on),
                          "arrivals": "Poisson (vLLM's --request-rate, --burstiness 1)",
                          "dataset": "vLLM's random dataset, --random-range-ratio 0, greedy (--temperature 0), "
                                     "EOS ignored",
                          "configs": [c.name for c in args.configs],
                          "links": [_link_name(g) for g in args.links],
                          "link_note": "unshaped: loopback; a number: tc htb on a `lynx link up --hosts 2` "
                                       f"link ({LINK_PREFIX}: producer tx, consumer rx0, proxy and client rx1), "
                                       "UCX tcp on the veths, Lynx's own shaper off",
                          "nixl": {"kv_connector_extra_config": NIXL_EXTRA,
                                   "ucx": "unshaped: UCX's own choice; shaped: the link's ucx_env (tcp, veth)"},
                          "model": str(args.model), "servers": "vllm.entrypoints.openai.api_server, one thread each "
                                                               "(OMP_NUM_THREADS=1), VLLM_CPU_KVCACHE_SPACE=1",
                          "consumer_ttft": "proxy decode_sent_at -> decode_first_byte_at (the decode leg's first "
                                           "streamed token)",
                          "commit": _commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                          "cpus": os.cpu_count(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
                          "errors": errors},
               "runs": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "breakdown.json").write_text(json.dumps(details, indent=2) + "\n")
    _plot(summary, out)
    return summary


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _plot(summary: dict[str, Any], out: Path) -> None:
    """``OUT/ttft.png``: here when matplotlib is, else from Lynx's main environment (the vLLM one has none)."""
    path = out / "ttft.png"
    if importlib.util.find_spec("matplotlib") is not None:
        plot_ttft(summary, path)
        say(f"wrote {path}")
        return
    main_python = ROOT / ".venv" / "bin" / "python"
    if not main_python.is_file():
        say(f"no plot: matplotlib is not here and there is no {main_python} (make install)")
        return
    try:
        done = subprocess.run([str(main_python), "-m", "lynx_bench.vllm.bench_summary", str(out / "summary.json"),
                               str(path)], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        say("no plot: the plotting process did not end within 180 s")
        return
    say(f"wrote {path}" if done.returncode == 0 else f"no plot: {done.stderr.strip()[-300:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The runner's settings (exits with the reason when they are bad)."""
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m lynx_bench.vllm.bench",
                                description="vLLM's own serving benchmark (vllm bench serve) against P/D "
                                            "configurations, from the vLLM environment (make vllm-env).",
                                epilog="\n\n".join(paragraphs[2:5]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("vllm-bench-out"))
    p.add_argument("--model", type=Path, default=None, help="a transformers directory (default: Lynx's default model)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="every prompt's length (default %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="requests per configuration (default %(default)s)")
    p.add_argument("--rate", type=parse_rate, default=None, metavar="R|auto",
                   help="requests per second (Poisson); auto (default): 0.7 x the producer's prefill throughput, "
                        "from one prefill of the prompt length timed before the runs")
    p.add_argument("--configs", type=parse_configs, default=parse_configs(DEFAULT_CONFIGS), metavar="C,C",
                   help=f"none, nixl, lynx-<bf16|int8|int4|lynx>[-async] (default {DEFAULT_CONFIGS})")
    p.add_argument("--links", type=parse_links, default=parse_links("unshaped"), metavar="L,L",
                   help="unshaped (default: loopback) and/or rates in Gbit/s held by Lynx's own sender-side shaper "
                        "only; NIXL at a shaped link and shaping with `lynx link up` namespaces are not in this "
                        "version")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (default %(default)s)")
    args = p.parse_args(argv)
    if args.prompt_tokens < 16:
        p.error(f"--prompt-tokens must be at least 16, got {args.prompt_tokens}")
    if args.requests < 1:
        p.error(f"--requests must be at least 1, got {args.requests}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _signals() -> Iterator[None]:
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from lynx_decode.model.store import converted_model_dir, default_gguf_path  # noqa: PLC0415 - model extra

        args.model = converted_model_dir(default_gguf_path())
    started = time.monotonic()
    try:
        with _signals():
            summary = run(args)
    except KeyboardInterrupt:
        say("interrupted: every server stopped")
        return 130
    except VllmNodeError as exc:
        say(str(exc))
        return 1
    print(table(summary["runs"]))
    say(f"wrote {args.out / 'summary.json'} in {time.monotonic() - started:.0f} s")
    bad = [r for r in summary["runs"] if r["failed"] and r["connector"] != "nixl"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
