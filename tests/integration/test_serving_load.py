"""A prefill node under load from several decode-node processes, on the real model
over UCX: many requests in flight at once, and a decode node killed mid-load.

The prefill node runs in the test process (so its pending count, peer table and
receive pool can be checked); each decode node is a child process
(``nodes.decode_server``) running its requests from threads, all at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from lynx_bench.accuracy.workload import filler_prose
from lynx_decode.prefill_node import PrefillNode
from lynx_decode.timeouts import Timeouts
from lynx_transport.testing import PeerProcess, wait_until

from .nodes import decode_server

pytestmark = [pytest.mark.model, pytest.mark.ucx]

NODES = 3
PER_NODE = 4
NEW_TOKENS = 12
POOL = 128 << 20


@pytest.fixture(scope="module")
def model() -> Any:
    from lynx_decode.model import HFCausalLM

    return HFCausalLM.load()


@pytest.fixture(scope="module")
def prompts(model: Any) -> list[list[int]]:
    """Short contexts (a few hundred tokens), seeds never used for tuning."""
    return [model.tokenize(filler_prose(model.tokenize, 200 + 60 * k, 300 + k)) for k in range(PER_NODE)]


@pytest.fixture
def prefill(model: Any) -> Iterator[PrefillNode]:
    with PrefillNode(model, timeouts=Timeouts(stream_s=120.0)) as node:
        stop = threading.Event()
        server = threading.Thread(target=node.serve, args=(stop,), kwargs={"poll_s": 0.05})
        server.start()
        try:
            yield node
        finally:
            stop.set()
            server.join(10)


def _decode_nodes(prefill: PrefillNode) -> list[PeerProcess]:
    children = [PeerProcess(decode_server, prefill.address, POOL) for _ in range(NODES)]
    for child in children:
        child.reply(300)  # its address: the model is loaded and the node listens
    return children


def _start(child: PeerProcess, jobs: list[tuple[list[int], str, int]]) -> None:
    child._conn.send(("run_many", jobs, 300.0))


def _idle(prefill: PrefillNode, peers: int) -> bool:
    return (prefill.pending == 0 and len(prefill.peers()) == peers
            and prefill.pool.free_bytes == prefill.pool.nbytes)


def test_twelve_requests_in_flight_from_three_decode_nodes_commit_int8s_tokens(
        prefill: PrefillNode, prompts: list[list[int]]) -> None:
    children = _decode_nodes(prefill)
    try:
        reference = children[0].call("run_many", [(ids, "int8", NEW_TOKENS) for ids in prompts], 300.0,
                                     timeout=300)
        assert all(r[0] != "error" for r in reference), reference
        for child in children:  # 12 LYNX requests at once, 4 from each node
            _start(child, [(ids, "lynx", NEW_TOKENS) for ids in prompts])
        replies = [child.reply(300) for child in children]
        for reply in replies:
            for k, result in enumerate(reply):
                assert result[0] != "error", result
                tokens, metrics = result
                assert tokens == reference[k][0], f"prompt {k}: lynx committed other tokens than int8"
                assert metrics["verified"] is True
                assert metrics["ttft_from_request_s"] >= metrics["ttft_s"]
        assert prefill.served == len(prompts) + NODES * PER_NODE
        assert wait_until(lambda: _idle(prefill, NODES), 10)
    finally:
        for child in children:
            child.close()


def test_a_decode_node_killed_mid_load_fails_only_its_own_requests(
        prefill: PrefillNode, prompts: list[list[int]]) -> None:
    children = _decode_nodes(prefill)
    try:
        for child in children:
            _start(child, [(ids, "lynx", 24) for ids in prompts])
        assert wait_until(lambda: prefill.served >= 1, 120)  # the load is under way ...
        children[2].kill()  # ... when one decode node dies (SIGKILL)
        for child in children[:2]:
            for result in child.reply(300):
                assert result[0] != "error", result  # the others' requests all complete
        # the prefill node freed the dead peer's state and is back to idle
        assert wait_until(lambda: _idle(prefill, NODES - 1), 30), (
            prefill.pending, prefill.peers(), prefill.pool.free_bytes)
        assert prefill.served >= 2 * PER_NODE
    finally:
        for child in children:
            child.close()
