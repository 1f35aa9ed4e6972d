"""Starting and stopping ``lynx load``'s nodes: the prefill node (the real ``lynx
serve``) and ``--decode-nodes`` decode node processes (:mod:`lynx_bench.load.sink` or
:mod:`lynx_bench.load.decode`), each in its own network namespace with ``--link
netns``; and :class:`Nodes`, the running set, whose decode nodes' ``RESULT`` lines
arrive on one queue.

Concurrency: one collector thread per decode node feeds the queue; everything
else runs on the caller's thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lynx_bench.common.node_args import timeout_argv
from lynx_bench.common.processes import Child, ChildError
from lynx_bench.common.progress import Progress
from lynx_bench.load.logic import DecodeMode, LoadConfig, ModelShape
from lynx_bench.sweep.config import LinkMode

__all__ = ["STARTUP_TIMEOUT_S", "NETNS_PAYLOAD", "RECORDS_FILE", "Nodes", "start_nodes"]

#: How long a node may take to start (the prefill node to listen, a decode node to be READY).
STARTUP_TIMEOUT_S = 300.0
#: the prefill node's send records (``lynx serve --records``), in the run's logs folder
RECORDS_FILE = "serve-records.jsonl"

#: Over ``--link netns`` the prefill node paces its payload at this fraction of the tc
#: rate: tc's htb counts whole frames, and TCP payload got 0.953-0.957 of its rate
#: (``lynx link measure``, 1 Gbit/s); paced any faster, the excess queues in the kernel.
NETNS_PAYLOAD = 0.93


class Nodes:
    """The running prefill node and decode nodes; RESULT lines of every decode node
    arrive on one queue (a collector thread per decode node)."""

    def __init__(self, serve: Child, decoders: list[Child]) -> None:
        self.serve = serve
        self.decoders = decoders
        self.results: queue.Queue[tuple[int, dict[str, Any] | BaseException]] = queue.Queue()
        self._threads = [threading.Thread(target=self._collect, args=(i, c), daemon=True,
                                          name=f"load-collect-{i}") for i, c in enumerate(decoders)]
        for t in self._threads:
            t.start()

    def _collect(self, index: int, child: Child) -> None:
        while True:
            try:
                line = child.expect("RESULT", 1e6)
                self.results.put((index, json.loads(line)))
            except (ChildError, ValueError) as exc:
                self.results.put((index, exc))
                return

    def send(self, node: int, jobs: list[dict[str, Any]]) -> None:
        self.decoders[node].send(json.dumps({"jobs": jobs}))

    def gather(self, want: set[str], deadline: float, what: str, bar: Progress | None = None, *,
               timed: bool = True) -> dict[str, dict[str, Any]]:
        """The results of the requests ``want``, waiting until ``deadline`` (monotonic); each
        one an item of ``bar`` (``timed``: its time counts towards the bar's estimate)."""
        got: dict[str, dict[str, Any]] = {}
        while len(got) < len(want):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{what}: {len(want) - len(got)} of {len(want)} requests unanswered "
                                 f"past the phase's deadline; see the logs in {self.serve.log_path.parent}")
            try:
                node, item = self.results.get(timeout=left)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise ChildError(f"decode node {node}: {item}") from item
            rid = str(item["request_id"])
            if rid in want and rid not in got:
                got[rid] = item
                if bar is not None:
                    bar.update(timed=timed)
        if self.serve.proc.poll() is not None:
            raise ChildError(f"the prefill node exited with code {self.serve.proc.returncode}; "
                             f"see {self.serve.log_path}")
        return got


def _python() -> list[str]:
    return [sys.executable]


@contextlib.contextmanager
def start_nodes(config: LoadConfig, shape: ModelShape, logs: Path, pool_bytes: int) -> Iterator[Nodes]:
    """Start the prefill node and the decode nodes (each in its namespace with ``--link
    netns``); stop every one of them, and take the link down, on exit."""
    link = None
    serve: Child | None = None
    decoders: list[Child] = []
    try:
        serve_env: dict[str, str] = {}
        listen = "127.0.0.1:0"
        if config.link is LinkMode.NETNS:
            from lynx_bench.netem.config import LinkConfig  # noqa: PLC0415
            from lynx_bench.netem.link import Link  # noqa: PLC0415 - needs root and the bench extra

            # a prefix of our own, so a link someone left up by hand does not collide
            link = Link(LinkConfig(rate_gbps=config.bandwidth_gbps, hosts=config.decode_nodes,
                                   prefix=f"lxl{os.getpid() % 100000}")).up()
            serve_env, listen = link.ucx_env("tx"), f"{link.address('tx')}:0"
        records = logs / RECORDS_FILE
        records.unlink(missing_ok=True)
        argv = [*_python(), "-m", "lynx_bench.cli", "serve", "--listen", listen, "--records", str(records),
                *timeout_argv(config.timeouts)]
        # the prefill node's egress, all decode nodes together; over an emulated link too,
        # where tc is the link: paced at its rate, the queue stays in Lynx's scheduler (by
        # priority) instead of in the kernel's socket and qdisc (first come, first served)
        # (tc counts frames: TCP/IP headers leave ~95 % of its rate to payload, measured)
        argv += ["--rate", repr(config.bandwidth_gbps * (1.0 if link is None else NETNS_PAYLOAD))]
        if link is not None:  # the data must cross the veth: tcp on it (cma would bypass tc)
            argv += ["--ucx-tls", "tcp", "--ucx-net-devices", link.device("tx")]
        if config.lane_policy is not None:
            argv += ["--lane-policy", config.lane_policy]
        if config.max_pending is not None:
            argv += ["--max-pending", str(config.max_pending)]
        serve = Child("prefill node", argv if link is None else link.exec_argv("tx", argv),
                      logs / "serve.log", env=serve_env)
        address = serve.expect("listening on", STARTUP_TIMEOUT_S)
        for i in range(config.decode_nodes):
            argv = _decoder_argv(config, shape, address, "127.0.0.1", pool_bytes)
            if link is not None:  # the data must cross the veth: tcp on it (cma would bypass tc)
                h = link.decode_hosts[i]
                argv = [*_decoder_argv(config, shape, address, link.address(h), pool_bytes),
                        "--ucx-tls", "tcp", "--ucx-net-devices", link.device(h)]
            decoders.append(Child(f"decode node {i}",
                                  argv if link is None else link.exec_argv(link.decode_hosts[i], argv),
                                  logs / f"decode{i}.log",
                                  env=None if link is None else link.ucx_env(link.decode_hosts[i])))
        for child in decoders:
            child.expect("READY", STARTUP_TIMEOUT_S)
        yield Nodes(serve, decoders)
    finally:
        for child in [*decoders, *([serve] if serve is not None else [])]:
            child.stop()
        if link is not None:
            link.down()


def _decoder_argv(config: LoadConfig, shape: ModelShape, address: str, listen_host: str,
                  pool_bytes: int) -> list[str]:
    common = ["--connect", address, "--listen-host", listen_host, "--context", str(config.context),
              "--prompts", str(config.prompts), "--seed", str(config.seed), "--vocab", str(shape.vocab),
              "--pool-bytes", str(pool_bytes), "--pool-wait", repr(config.request_timeout_s)]
    if config.decode is DecodeMode.SINK:
        return [*_python(), "-m", "lynx_bench.load.sink", *common, *timeout_argv(config.timeouts)]
    return [*_python(), "-m", "lynx_bench.load.decode", *common, "--new-tokens", str(config.new_tokens),
            *timeout_argv(config.timeouts, residual=True)]
