"""Test helpers: a real ``lynx serve`` process (the prefill node) for two-process tests.

The child's stderr goes to a temp file whose tail is attached to any failure, so a
crash in the child shows its traceback in the test report.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lynx_bench.common.processes import Child

__all__ = ["serve_process", "decode_server"]


@contextlib.contextmanager
def serve_process(startup_timeout: float = 300.0) -> Iterator[tuple[Child, tuple[str, int]]]:
    """A ``lynx serve`` child on an ephemeral loopback port; yields (child, address)."""
    log = Path(tempfile.mkstemp(prefix="lynx-serve-", suffix=".log")[1])
    child = Child("lynx serve", [sys.executable, "-m", "lynx_bench.cli", "serve",
                                 "--listen", "127.0.0.1:0"], log)
    try:
        host, port = child.expect("listening on", startup_timeout).rsplit(":", 1)
        yield child, (host, int(port))
    finally:
        child.stop()
        log.unlink(missing_ok=True)


def decode_server(pipe: Any, server: tuple[str, int], pool_bytes: int) -> None:
    """Child side (a ``PeerProcess`` target): a decode node with the real model on one
    torch thread, answering ``("run_many", [(ids, scheme, new_tokens), ...], timeout)``
    with one ``(tokens, metrics)`` or ``("error", text)`` per run, all run at once
    from threads (requests in flight together), and ``("exit",)``."""
    from lynx_decode.codec.config import Scheme
    from lynx_decode.decode_node import DecodeNode
    from lynx_decode.model import HFCausalLM
    from lynx_decode.timeouts import Timeouts

    model = HFCausalLM.load(num_threads=1)
    with DecodeNode(model, pool_bytes=pool_bytes, timeouts=Timeouts(stream_s=120.0)) as node:
        pipe.send(("ok", node.address))
        while True:
            request = pipe.recv()
            if request[0] == "exit":
                return
            _, jobs, timeout = request
            results: list[Any] = [None] * len(jobs)

            def one(i: int, ids: list[int], scheme: str, new_tokens: int, results: list[Any] = results) -> None:
                try:
                    r = node.run(server, ids, scheme=Scheme(scheme), max_new_tokens=new_tokens)
                    results[i] = (list(r.tokens), r.metrics)
                except Exception as exc:
                    results[i] = ("error", f"{type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            pipe.send(("ok", results))
