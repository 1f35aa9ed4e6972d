"""Link configuration: units, validation and lane port ranges — all checked before
anything touches the system (these tests need no root and create nothing)."""

from __future__ import annotations

import pytest

from lynx_bench.cli import main
from lynx_bench.netem.config import (
    MAX_HOSTS,
    Host,
    LinkConfig,
    PortRange,
    Side,
    owned_namespaces,
    parse_duration,
    parse_percent,
    parse_rate,
)
from lynx_transport.errors import ConfigError


@pytest.mark.parametrize(("text", "gbps"), [
    ("1gbit", 1.0), ("1Gbit", 1.0), ("1gbit/s", 1.0), ("500mbit", 0.5), ("100kbit", 1e-4),
    ("2.5", 2.5), ("10", 10.0), ("1e3mbit", 1.0), ("1000000bit", 1e-3),
    ("1gibit", 2 ** 30 / 1e9), ("512mibit", 512 * 2 ** 20 / 1e9), (" 2 gbit ", 2.0),
    (0.25, 0.25), (3, 3.0),
])
def test_parse_rate_reads_tc_bit_units_and_plain_gbps(text: str | float, gbps: float) -> None:
    assert parse_rate(text) == pytest.approx(gbps)


@pytest.mark.parametrize("text", [
    "0", "0gbit", "-1", "-1gbit", 0, -2.0, float("nan"), float("inf"),
    "1gbps", "100mbps", "8bps",  # tc byte units: refused, not guessed
    "1 gigabit", "fast", "", "1xbit", "gbit", True, "0.0000001bit", "5000gbit",
])
def test_parse_rate_rejects_bad_input(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_rate(text)  # type: ignore[arg-type]


def test_byte_units_error_says_what_to_write() -> None:
    with pytest.raises(ConfigError, match="'1gbit'"):
        parse_rate("1gbps")


@pytest.mark.parametrize(("text", "ms"), [("10ms", 10.0), ("1s", 1000.0), ("500us", 0.5),
                                          ("3", 3.0), (2, 2.0), ("0", 0.0)])
def test_parse_duration(text: str | float, ms: float) -> None:
    assert parse_duration(text) == pytest.approx(ms)


@pytest.mark.parametrize("text", ["-1ms", "10 parsecs", "ms", "2h", "100s"])
def test_parse_duration_rejects_bad_input(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration(text)


@pytest.mark.parametrize(("text", "pct"), [("1%", 1.0), ("0.5", 0.5), (100, 100.0)])
def test_parse_percent(text: str | float, pct: float) -> None:
    assert parse_percent(text) == pytest.approx(pct)


@pytest.mark.parametrize("text", ["101%", "-1", "lots"])
def test_parse_percent_rejects_bad_input(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_percent(text)


def test_config_names_addresses_and_burst() -> None:
    cfg = LinkConfig(rate_gbps=1.0, prefix="lx", subnet="10.9.8.0/30")
    assert cfg.namespace(Side.TX) == "lx-tx" and cfg.namespace("rx") == "lx-rx"
    assert cfg.device("tx") == "lx-tx"
    assert (cfg.address("tx"), cfg.address(Side.RX)) == ("10.9.8.1", "10.9.8.2")
    assert cfg.prefixlen == 30
    assert cfg.burst == 128 * 1024  # 1 ms at 1 Gbit/s is 125 kB, floor one GSO packet
    assert LinkConfig(rate_gbps=10.0).burst == 1_250_000
    assert not cfg.wants_netem
    assert LinkConfig(rate_gbps=1.0, loss_pct=0.1).wants_netem


def test_lane_port_ranges_are_aligned_for_one_u32_mask() -> None:
    cfg = LinkConfig(rate_gbps=1.0, lanes=3, lane_port_base=40960, lane_port_block=256)
    assert cfg.lane_ports(0) == PortRange(40960, 41215)
    assert cfg.lane_ports(2) == PortRange(41472, 41727)
    assert cfg.lane_ports(1).ucx == "41216-41471"
    for lane in range(3):
        ports = cfg.lane_ports(lane)
        assert all((p & ports.mask) == ports.low for p in range(ports.low, ports.high + 1))
        assert (ports.low - 1) & ports.mask != ports.low
        assert (ports.high + 1) & ports.mask != ports.low
    with pytest.raises(ConfigError):
        cfg.lane_ports(3)


@pytest.mark.parametrize("kwargs", [
    {"rate_gbps": 0}, {"rate_gbps": -1.0}, {"rate_gbps": "1gbit"}, {"rate_gbps": float("nan")},
    {"prefix": "Lynx"}, {"prefix": "a-very-long-prefix"}, {"prefix": "1x"}, {"prefix": ""},
    {"subnet": "8.8.8.0/30"},  # public addresses: never
    {"subnet": "10.0.0.0/31"}, {"subnet": "10.0.0.1/30"}, {"subnet": "fd00::/64"},
    {"subnet": "nonsense"},
    {"delay_ms": -1.0}, {"loss_pct": 101.0}, {"jitter_ms": 1.0},  # jitter without delay
    {"lanes": -1}, {"lanes": 9}, {"lanes": 2, "lane_port_block": 100},
    {"lanes": 2, "lane_port_base": 40000},  # not aligned to the block
    {"lanes": 8, "lane_port_base": 65024, "lane_port_block": 256},  # past 65535
    {"burst_bytes": 10},
    {"hosts": 0}, {"hosts": -1}, {"hosts": MAX_HOSTS + 1}, {"hosts": True}, {"hosts": 2.0},
    {"hosts": "3"},
    {"hosts": 2, "subnet": "10.0.0.0/30"},  # 2 addresses, 3 hosts
    {"hosts": 8, "subnet": "10.0.0.0/29"},  # 6 addresses, 9 hosts
    {"hosts": 2, "prefix": "twelve-chars"},  # twelve-chars-rx1: 16 > 15 characters
    {"hosts": 11, "prefix": "elevenchars"},  # elevenchars-rx10: 16
])
def test_bad_config_raises_config_error(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"rate_gbps": 1.0, **kwargs}
    with pytest.raises(ConfigError):
        LinkConfig(**args)  # type: ignore[arg-type]


def test_one_decode_host_keeps_the_two_namespace_names() -> None:
    cfg = LinkConfig(rate_gbps=1.0, prefix="lx")
    assert cfg.hosts == 1 and not cfg.switched
    assert cfg.decode_hosts == (Host(Side.RX, 0),) and cfg.prefill_host == Host(Side.TX)
    assert cfg.network.with_prefixlen == "10.254.0.0/30"
    assert cfg.namespaces == ("lx-tx", "lx-rx")
    for ref in ("rx", "rx0", Side.RX, Host(Side.RX, 0)):
        assert cfg.namespace(ref) == "lx-rx" and cfg.address(ref) == "10.254.0.2"
    assert cfg.address("rx", 0) == "10.254.0.2" and cfg.host_name("rx", 0) == "rx"


def test_several_decode_hosts_are_numbered_and_share_a_subnet() -> None:
    cfg = LinkConfig(rate_gbps=1.0, prefix="lx", hosts=3)
    assert cfg.switched and len(cfg.decode_hosts) == 3
    assert cfg.network.with_prefixlen == "10.254.0.0/27" and cfg.prefixlen == 27
    assert cfg.namespaces == ("lx-tx", "lx-rx0", "lx-rx1", "lx-rx2", "lx-sw")
    assert [cfg.device(h) for h in cfg.decode_hosts] == ["lx-rx0", "lx-rx1", "lx-rx2"]
    assert [cfg.address(h) for h in cfg.all_hosts] == [
        "10.254.0.1", "10.254.0.2", "10.254.0.3", "10.254.0.4"]
    assert cfg.host("rx", 2) == cfg.host("rx2") == cfg.host(Side.RX, 2) == Host(Side.RX, 2)
    assert cfg.switch_port("tx") == "tx" and cfg.switch_port("rx", 1) == "rx1"
    assert LinkConfig(rate_gbps=1.0, hosts=3, subnet="192.168.7.0/29").address("rx2") == \
        "192.168.7.4"
    # the longest prefix that still names MAX_HOSTS devices within 15 characters
    wide = LinkConfig(rate_gbps=1.0, prefix="tencharsxx", hosts=MAX_HOSTS)
    assert max(len(wide.device(h)) for h in wide.all_hosts) == 15


@pytest.mark.parametrize(("ref", "index"), [
    ("rx", None), (Side.RX, None),  # three decode hosts: which one?
    ("rx", 3), ("rx3", None), (Host(Side.RX, 3), None), ("rx", -1), ("rx", True),
    ("tx", 1), ("tx1", None), ("rx1", 1), (Host(Side.RX, 1), 1),
    ("decode", None), ("", None), (3, None),
])
def test_naming_a_host_that_is_not_there_is_a_config_error(ref: object, index: object) -> None:
    cfg = LinkConfig(rate_gbps=1.0, hosts=3)
    with pytest.raises(ConfigError):
        cfg.address(ref, index)  # type: ignore[arg-type]


def test_too_long_a_prefix_for_the_hosts_says_how_long_it_may_be() -> None:
    with pytest.raises(ConfigError, match="at most 11 characters"):
        LinkConfig(rate_gbps=1.0, prefix="twelve-chars", hosts=2)


def test_owned_namespaces_are_only_a_links_own_names() -> None:
    existing = ["lx-sw", "lx-rx10", "lx-rx2", "lx-tx", "lx-rx", "lx-rx16", "lx-rx02", "lx-foo",
                "lx-rx1-tx", "lxx-tx", "other", "lx-tx-sw", "lx-rx15"]
    assert owned_namespaces("lx", existing) == ["lx-tx", "lx-rx", "lx-rx2", "lx-rx10",
                                                "lx-rx15", "lx-sw"]
    assert owned_namespaces("lx-rx1", existing) == ["lx-rx1-tx"]
    assert owned_namespaces("a.b", ["a.b-tx", "axb-tx"]) == ["a.b-tx"]


@pytest.mark.parametrize("argv", [
    ["--rate", "0"], ["--rate=-1gbit"], ["--rate", "1gbps"], ["--rate", "1furlong"],
    ["--rate", "1gbit", "--loss", "200%"], ["--rate", "1gbit", "--delay", "soon"],
    ["--rate", "1gbit", "--prefix", "NO_CAPS"],
    ["--rate", "1gbit", "--hosts", "0"], ["--rate", "1gbit", "--hosts", "17"],
    ["--rate", "1gbit", "--hosts", "3", "--subnet", "10.254.0.0/30"],
])
def test_cli_rejects_bad_input_before_touching_the_system(
        argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: object) -> None:
    # no ip/tc on PATH: reaching for the system would fail with a root/iproute2 message
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["link", "up", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lynx: error: ")
    assert "root" not in err  # the argument, not the environment, is reported
