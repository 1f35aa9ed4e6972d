"""The nodes' CLI flags. Every ``--*-timeout`` flag of ``lynx serve`` / ``lynx generate`` / ``lynx sweep``
reaches what it bounds: the transport's config and ``connect``, or the node's waits.

The nodes are built from the parsed command line exactly as the CLI builds them
(``serve.prefill_node``, ``generate.decode_node``), over a transport that
records what the node asks of it and hands each call to the real UCX transport.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest

from lynx_bench.cli import _parser, configure_logging
from lynx_bench.common.node_args import timeout_argv, timeouts
from lynx_bench.nodes import generate, serve
from lynx_bench.sweep.cli import config_from_args
from lynx_decode.codec.config import Scheme
from lynx_decode.model.protocol import ModelInfo
from lynx_decode.timeouts import Timeouts
from lynx_transport import UCX
from lynx_transport.config import TransportConfig
from lynx_transport.errors import ConfigError, ConnectError
from lynx_transport.seam import EgressLike, Listener, ReceiverCallbacks, Sender
from lynx_transport.ucx.transport import UcxTransport

pytestmark = pytest.mark.ucx


class Spy:
    """A transport that records the node's calls and hands them to UCX."""

    def __init__(self) -> None:
        self.listens: list[TransportConfig] = []
        self.connects: list[tuple[tuple[str, int], float, TransportConfig | None]] = []
        self.rates: list[Any] = []
        self.egresses: list[SpyEgress] = []

    def connect(self, address: tuple[str, int], *, timeout: float,
                config: TransportConfig | None = None) -> Sender:
        self.connects.append((address, timeout, config))
        return UCX.connect(address, timeout=timeout, config=config)

    def egress(self, config: TransportConfig | None = None) -> EgressLike:
        self.egresses.append(egress := SpyEgress(self, config))
        return egress

    def listen(self, pool: Any, *, host: str = "127.0.0.1", port: int = 0,
               config: TransportConfig | None = None,
               callbacks: ReceiverCallbacks | None = None) -> Listener:
        assert config is not None
        self.listens.append(config)
        return UCX.listen(pool, host=host, port=port, config=config, callbacks=callbacks)


class SpyEgress:
    """The spy's egress: records each ``connect`` like the spy, then hands it to UCX's."""

    def __init__(self, spy: Spy, config: TransportConfig | None) -> None:
        self.spy, self.config = spy, config
        self.inner = UcxTransport().egress(config)

    def connect(self, address: tuple[str, int], *, timeout: float) -> Sender:
        self.spy.connects.append((address, timeout, self.config))
        return self.inner.connect(address, timeout=timeout)

    def set_link_rate(self, rate: Any) -> None:
        self.spy.rates.append(rate)
        self.inner.set_link_rate(rate)

    def peers(self) -> list[tuple[str, int]]:
        return self.inner.peers()

    def close(self, timeout: float = 5.0) -> None:
        self.inner.close(timeout)


class InfoOnly:
    """All a node needs of its model to start (it never runs one here)."""

    info = ModelInfo("toy", 2, 1, 16, 4096, 40, frozenset())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate_args(*flags: str, tmp_path: Any) -> Any:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    return _parser().parse_args(["generate", "--connect", f"127.0.0.1:{_closed_port()}",
                                 "--prompt-file", str(prompt), "--json", str(tmp_path / "o.json"),
                                 *flags])


@pytest.mark.parametrize(("flag", "field"), [("--handshake-timeout", "handshake_timeout_s"),
                                             ("--peer-timeout", "peer_timeout_s")])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_transport_timeouts_reach_the_listener(flag: str, field: str, command: str,
                                               tmp_path: Any) -> None:
    spy = Spy()
    if command == "serve":
        args = _parser().parse_args(["serve", "--no-prefill-cache", flag, "0.75"])
        node: Any = serve.prefill_node(args, InfoOnly(), transport=spy)  # type: ignore[arg-type]
    else:
        args = _generate_args(flag, "0.75", tmp_path=tmp_path)
        node = generate.decode_node(args, InfoOnly(), transport=spy)  # type: ignore[arg-type]
    with node:
        [config] = spy.listens
        assert getattr(config, field) == 0.75
        assert config.heartbeat_interval_s < config.peer_timeout_s


def test_connect_timeout_reaches_connect(tmp_path: Any) -> None:
    spy = Spy()
    args = _generate_args("--connect-timeout", "0.4", tmp_path=tmp_path)
    node = generate.decode_node(args, InfoOnly(), transport=spy)  # type: ignore[arg-type]
    with node, pytest.raises(ConnectError):
        node.run(("127.0.0.1", _closed_port()), [1, 2, 3], scheme=Scheme.INT8)
    [(_, timeout, config)] = spy.connects
    assert timeout == 0.4
    assert config is spy.listens[0]  # the same transport settings both ways


@pytest.mark.parametrize("flag", ["--stream-timeout", "--timeout"])
def test_stream_and_residual_timeouts_reach_the_decode_node(flag: str, tmp_path: Any) -> None:
    args = _generate_args(flag, "7", "--residual-timeout", "2.5", tmp_path=tmp_path)
    with generate.decode_node(args, InfoOnly(), transport=Spy()) as node:  # type: ignore[arg-type]
        assert node.timeouts == Timeouts(stream_s=7.0, residual_s=2.5)
        assert node.timeout_s == 7.0


def test_serve_stream_timeout_reaches_the_prefill_node() -> None:
    args = _parser().parse_args(["serve", "--no-prefill-cache", "--stream-timeout", "9",
                                 "--connect-timeout", "3"])
    with serve.prefill_node(args, InfoOnly(), transport=Spy()) as node:  # type: ignore[arg-type]
        assert node.timeouts == Timeouts(connect_s=3.0, stream_s=9.0)
        assert node.stream_timeout_s == 9.0


def test_sweep_hands_its_timeouts_to_both_node_processes() -> None:
    args = _parser().parse_args(["sweep", "--quick", "--peer-timeout", "2", "--connect-timeout", "4",
                                 "--residual-timeout", "6"])
    config = config_from_args(args)
    assert config.timeouts == Timeouts(connect_s=4.0, peer_s=2.0, residual_s=6.0)
    serve = _parser().parse_args(["serve", *timeout_argv(config.timeouts)])
    assert timeouts(serve) == Timeouts(connect_s=4.0, peer_s=2.0)  # serve has no residual wait
    worker_flags = timeout_argv(config.timeouts, residual=True)
    assert worker_flags[worker_flags.index("--residual-timeout") + 1] == "6.0"


@pytest.mark.parametrize("flag", ["--connect-timeout", "--handshake-timeout", "--peer-timeout",
                                  "--stream-timeout", "--residual-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bad_timeouts_are_config_errors(flag: str, value: str, tmp_path: Any) -> None:
    args = _generate_args(flag, value, tmp_path=tmp_path)
    with pytest.raises(ConfigError, match=flag):
        timeouts(args)


@pytest.mark.parametrize(("argv", "level"), [(["serve"], logging.INFO),
                                              (["--log-level", "warning", "serve"], logging.NOTSET),
                                              (["info"], logging.NOTSET)])
def test_serve_logs_one_line_per_request_by_default(argv: list[str], level: int) -> None:
    """`lynx serve` shows Lynx's INFO lines (one per request) unless --log-level says
    otherwise; other libraries' INFO lines stay hidden (the root stays at WARNING)."""
    configure_logging(_parser().parse_args(argv))
    try:
        assert logging.getLogger("lynx_decode").level == level
        assert logging.getLogger().level in (logging.WARNING, logging.getLevelName("WARNING"))
    finally:
        logging.getLogger("lynx_decode").setLevel(logging.NOTSET)


def test_serve_rate_shapes_the_whole_egress_and_admission_flags_reach_the_node() -> None:
    spy = Spy()
    args = _parser().parse_args(["serve", "--no-prefill-cache", "--rate", "2.5", "--max-pending", "3",
                                 "--memory-cache", "0"])
    with serve.prefill_node(args, InfoOnly(), transport=spy) as node:  # type: ignore[arg-type]
        [rate] = spy.rates
        assert rate.gbps == 2.5
        assert node.max_pending == 3
        assert spy.listens[0].lane_policy is TransportConfig().lane_policy


@pytest.mark.parametrize("policy", ["fifo", "srf", "drr"])
def test_serve_lane_policy_reaches_the_egress(policy: str) -> None:
    spy = Spy()
    args = _parser().parse_args(["serve", "--no-prefill-cache", "--lane-policy", policy])
    with serve.prefill_node(args, InfoOnly(), transport=spy):  # type: ignore[arg-type]
        [egress] = spy.egresses
        assert egress.config.lane_policy.value == policy


@pytest.mark.parametrize("flags", [["--rate", "0"], ["--rate", "nan"], ["--max-pending", "0"],
                                   ["--memory-cache", "-1"]])
def test_bad_serve_flags_are_config_errors_before_the_model_loads(flags: list[str]) -> None:
    args = _parser().parse_args(["serve", *flags])
    with pytest.raises(ConfigError, match=flags[0]):
        serve.run(args)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_ucx_flags_pin_the_nodes_transports(command: str, tmp_path: Any) -> None:
    """An emulated link needs its nodes on tcp over their veth (UCX's own settings win
    over UCX_* variables; cma between two processes of one host bypasses tc)."""
    spy = Spy()
    flags = ["--ucx-tls", "tcp", "--ucx-net-devices", "lo"]
    if command == "serve":
        node: Any = serve.prefill_node(_parser().parse_args(["serve", "--no-prefill-cache", *flags]),
                                           InfoOnly(), transport=spy)  # type: ignore[arg-type]
    else:
        node = generate.decode_node(_generate_args(*flags, tmp_path=tmp_path), InfoOnly(),
                                        transport=spy)  # type: ignore[arg-type]
    with node:
        [config] = spy.listens
        assert (config.ucx_tls, config.ucx_net_devices) == ("tcp", "lo")
