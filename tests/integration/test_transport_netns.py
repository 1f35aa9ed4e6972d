"""A transfer across a veth link between two network namespaces; the link goes down mid-transfer.

The receiver runs in the ``rx`` namespace, the sender in ``tx`` (UCX over tcp
on the veth, pinned through ``TransportConfig.ucx_tls``/``ucx_net_devices``,
which override ``UCX_TLS``/``UCX_NET_DEVICES``). Once data flows, the veth is
set down: no FIN, no RST, just silence. The receiver must report the stream
failed by its heartbeats (``peer_timeout_s`` set to 1.5 s here, the default being
30 s for busy hosts); that it does so within the bound (2 s) is a timing check
(marked ``timing``), the default run allows ten times that.
Children report on stdout as JSON lines; their stderr (tracebacks) is attached
to any failure. The namespaces are always removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.ucx]

BOUND_S = 2.0

RECEIVER = r"""
import json, sys, time
from lynx_transport import ReceivePool, Receiver, TransportConfig
from lynx_transport.errors import TransportError
def say(**kw):
    print(json.dumps(kw), flush=True)
cfg = TransportConfig(chunk_bytes=256 * 1024, ucx_tls="tcp", ucx_net_devices=sys.argv[2], peer_timeout_s=1.5)
landed = []
with Receiver(ReceivePool(512 << 20), host=sys.argv[1], config=cfg,
              on_chunk=lambda s, r, o, n: landed or (landed.append(1), say(event="chunk",
                                                     t=time.monotonic()))) as rx:
    say(event="listening", port=rx.address[1])
    stream = rx.next_stream(60)
    try:
        stream.wait(60)
        say(event="completed", t=time.monotonic())
    except TransportError as exc:
        say(event="failed", t=time.monotonic(), error=type(exc).__name__, message=str(exc))
"""

SENDER = r"""
import json, sys
import numpy as np
from lynx_transport import Lane, TransportConfig, connect
from lynx_transport.errors import TransportError
cfg = TransportConfig(chunk_bytes=256 * 1024, ucx_tls="tcp", ucx_net_devices=sys.argv[3], peer_timeout_s=1.5)
data = np.full(400 << 20, 7, np.uint8)  # ~3.4 s at 1 Gbit/s
with connect((sys.argv[1], int(sys.argv[2])), timeout=20, config=cfg) as conn:
    s = conn.send_stream([("a", data[: 4 << 20], Lane.ANCHOR), ("r", data, Lane.RESIDUAL)])
    try:
        s.wait(30)
        print(json.dumps({"state": s.state.value}), flush=True)
    except TransportError as exc:
        print(json.dumps({"state": s.state.value, "error": type(exc).__name__}), flush=True)
"""


_BUFFERS: dict[int, bytearray] = {}


def read_event(child: subprocess.Popen, want: str, timeout: float) -> dict:
    """The next JSON line from ``child`` with ``event == want`` (bounded by ``timeout``).

    Reads the pipe with ``os.read`` (no Python-side buffering hides lines from select).
    """
    import selectors

    fd = child.stdout.fileno()
    buf = _BUFFERS.setdefault(fd, bytearray())
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in buf:
                line, _, rest = bytes(buf).partition(b"\n")
                buf[:] = rest
                if line.startswith(b"{"):  # UCX writes its warnings to stdout too
                    event = json.loads(line)
                    if event.get("event") == want:
                        return event
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            data = os.read(fd, 65536)
            if not data:
                break
            buf += data
    child.kill()
    _, err = child.communicate()
    raise AssertionError(f"no {want!r} event from the child; its stderr:\n{err}")


@pytest.fixture
def link():
    from lynx_bench.netem.config import LinkConfig
    from lynx_bench.netem.link import Link

    if os.geteuid() != 0:
        pytest.fail("netns tests need root (run them as root or deselect -m 'not netns')")
    with Link(LinkConfig(rate_gbps=1.0, prefix=f"lxf{os.getpid() % 10000}")) as lk:
        yield lk


def _veth_down_mid_transfer(link) -> tuple[dict, float]:
    """A transfer from tx to rx, the veth set down once data flows; the receiver's "failed"
    event and the seconds from the link going down to it."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    rx_host = link.address("rx")
    children: list[subprocess.Popen] = []

    def start(side: str, argv: list[str]) -> subprocess.Popen:
        child = link.popen_in(side, [sys.executable, "-c", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env)
        children.append(child)
        return child

    try:
        receiver = start("rx", [RECEIVER, rx_host, link.device("rx")])
        port = read_event(receiver, "listening", 60)["port"]
        sender = start("tx", [SENDER, rx_host, str(port), link.device("tx")])
        read_event(receiver, "chunk", 60)  # data is crossing the veth
        down = time.monotonic()
        subprocess.run(["ip", "netns", "exec", link.namespace("tx"), "ip", "link", "set",
                        link.device("tx"), "down"], check=True)
        failed = read_event(receiver, "failed", 10 * BOUND_S)
        assert failed["error"] == "PeerDisconnectedError", failed
        assert "silent" in failed["message"], failed  # by its heartbeats: nothing else reaches it
        out, err = sender.communicate(timeout=30)
        results = [json.loads(x) for x in out.splitlines() if x.startswith(b"{")]
        assert results and results[-1]["state"] == "failed", err
        receiver.communicate(timeout=30)
        return failed, failed["t"] - down
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()


def test_veth_down_mid_transfer_is_detected_by_the_heartbeats(link) -> None:
    failed, took = _veth_down_mid_transfer(link)
    assert took < 10 * BOUND_S, f"the receiver noticed the dead link after {took:.2f} s: {failed}"


@pytest.mark.timing
def test_veth_down_mid_transfer_is_detected_within_the_bound(link, timing) -> None:
    _, took = _veth_down_mid_transfer(link)
    timing.less_than("from the veth going down to the receiver's failure", took, BOUND_S)
