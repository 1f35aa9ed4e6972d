"""Configuration of an emulated link: rates, delays, lanes, hosts — parsed and
validated before anything touches the system (every problem is a :class:`ConfigError`).

Rates are bits per second. Text accepts tc's bit units (``bit``, ``kbit``,
``mbit``, ``gbit``, ``tbit`` and the binary ``kibit``, ``mibit``, ``gibit``,
``tibit``), an optional ``/s``, or a plain number meaning Gbit/s (``2.5``). tc's
*byte* units (``bps``, ``kbps``, ``mbps``, ``gbps`` — ``1gbps`` is 8 Gbit/s to
tc) are refused rather than guessed at.
"""

from __future__ import annotations

import enum
import ipaddress
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

from lynx_transport.errors import ConfigError

__all__ = [
    "Side",
    "Host",
    "HostRef",
    "PortRange",
    "LinkConfig",
    "MAX_HOSTS",
    "BRIDGE",
    "owned_namespaces",
    "parse_rate",
    "parse_duration",
    "parse_percent",
]

_BIT_UNITS = {
    "": 1e9, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2.0 ** 10, "mibit": 2.0 ** 20, "gibit": 2.0 ** 30, "tibit": 2.0 ** 40,
}
_BYTE_UNITS = {"bps", "kbps", "mbps", "gbps", "tbps", "kibps", "mibps", "gibps", "tibps"}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
_RATE = re.compile(rf"^\s*{_NUMBER}\s*([a-z]*)(/s)?\s*$", re.IGNORECASE)
_DURATION = re.compile(rf"^\s*{_NUMBER}\s*(s|ms|us|usec|msec|sec)?\s*$", re.IGNORECASE)
_PERCENT = re.compile(rf"^\s*{_NUMBER}\s*%?\s*$")
_DURATION_MS = {None: 1.0, "ms": 1.0, "msec": 1.0, "s": 1e3, "sec": 1e3, "us": 1e-3, "usec": 1e-3}
_PREFIX = re.compile(r"^[a-z][a-z0-9-]{0,11}$")
_HOST_NAME = re.compile(r"^(tx|rx)(0|[1-9][0-9]?)?$")
_IFNAMSIZ = 15  # the kernel's limit on a device name, without the NUL

MIN_RATE_GBPS = 1e-6  # 1 kbit/s
MAX_RATE_GBPS = 1000.0
#: most decode hosts one link may have
MAX_HOSTS = 16
#: the bridge device in the switch namespace ``{prefix}-sw`` (links with hosts > 1)
BRIDGE = "br"
_SUBNET_ONE = "10.254.0.0/30"  # the default for one decode host
_SUBNET_MANY = "10.254.0.0/27"  # the default for more: room for 1 + MAX_HOSTS addresses


class Side(enum.Enum):
    """An end of the link: ``TX`` sends the KV cache (prefill), ``RX`` receives it (decode)."""

    TX = "tx"
    RX = "rx"


@dataclass(frozen=True)
class Host:
    """One host on the link: the prefill host (``Side.TX``, index 0) or decode host
    ``index`` (``Side.RX``, 0 ... hosts-1). Take them from
    :attr:`LinkConfig.prefill_host` and :attr:`LinkConfig.decode_hosts`."""

    side: Side
    index: int = 0


#: what names a host: a :class:`Host`, a :class:`Side` (``RX`` only where there is one
#: decode host), or text: ``"tx"``, ``"rx"``, ``"rx<i>"`` (decode host ``i``)
HostRef: TypeAlias = "Host | Side | str"


def owned_namespaces(prefix: str, existing: Iterable[str]) -> list[str]:
    """Those of ``existing`` that a link named ``prefix`` creates, whatever its number
    of hosts — ``{prefix}-tx``, ``-rx``, ``-rx0`` ... ``-rx15``, ``-sw`` — in that
    order. Nothing else, so a teardown never touches a namespace it did not name."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(?:(tx|rx|sw)|rx(0|[1-9][0-9]?))$")
    rank = {"tx": -2, "rx": -1, "sw": MAX_HOSTS}
    mine = []
    for name in set(existing):
        match = pattern.match(name)
        if match is None:
            continue
        fixed, digits = match.groups()
        if digits is None:
            mine.append((rank[fixed], name))
        elif int(digits) < MAX_HOSTS:
            mine.append((int(digits), name))
    return [name for _, name in sorted(mine)]


@dataclass(frozen=True)
class PortRange:
    """An inclusive TCP port range, aligned so one u32 mask matches it exactly."""

    low: int
    high: int

    @property
    def mask(self) -> int:
        return 0xFFFF & ~(self.high - self.low)

    @property
    def ucx(self) -> str:
        """The value for ``UCX_TCP_PORT_RANGE``."""
        return f"{self.low}-{self.high}"


def parse_rate(value: str | float) -> float:
    """A rate in Gbit/s from ``"1gbit"``, ``"500mbit"``, ``"2.5"``, ``2.5`` ..."""
    if isinstance(value, bool):
        raise ConfigError(f"rate must be a number or text like '1gbit', got {value!r}")
    if isinstance(value, (int, float)):
        gbps = float(value)
    else:
        match = _RATE.match(str(value))
        if match is None:
            raise ConfigError(f"cannot read rate {value!r}: write e.g. '1gbit', '500mbit' "
                              "or a plain number of Gbit/s such as '2.5'")
        unit = match.group(2).lower()
        if unit in _BYTE_UNITS:
            raise ConfigError(f"rate {value!r} is in bytes per second in tc's units "
                              f"('1gbps' = 8 Gbit/s); give the rate in bits, e.g. "
                              f"'{match.group(1)}gbit' for {match.group(1)} Gbit/s")
        if unit not in _BIT_UNITS:
            raise ConfigError(f"unknown rate unit {match.group(2)!r} in {value!r}; use one of "
                              f"{', '.join(u for u in _BIT_UNITS if u)} or none for Gbit/s")
        gbps = float(match.group(1)) * _BIT_UNITS[unit] / 1e9
    _check_rate("rate", gbps)
    return gbps


def _check_rate(name: str, gbps: float) -> None:
    if not math.isfinite(gbps) or gbps <= 0:
        raise ConfigError(f"{name} must be a positive number of Gbit/s, got {gbps!r}")
    if not MIN_RATE_GBPS <= gbps <= MAX_RATE_GBPS:
        raise ConfigError(f"{name} {gbps} Gbit/s is outside [1 kbit/s, {MAX_RATE_GBPS:g} Gbit/s]")


def parse_duration(value: str | float) -> float:
    """Milliseconds from ``"10ms"``, ``"1s"``, ``"500us"`` or a plain number of ms."""
    if isinstance(value, bool):
        raise ConfigError(f"duration must be a number or text like '10ms', got {value!r}")
    if isinstance(value, (int, float)):
        ms = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ConfigError(f"cannot read duration {value!r}: write e.g. '10ms', '1s', '500us'")
        unit = match.group(2).lower() if match.group(2) else None
        ms = float(match.group(1)) * _DURATION_MS[unit]
    if not math.isfinite(ms) or not 0 <= ms <= 60_000:
        raise ConfigError(f"duration must be between 0 and 60 s, got {value!r}")
    return ms


def parse_percent(value: str | float) -> float:
    """A percentage from ``"1%"``, ``"0.5"`` or ``0.5``; must lie in [0, 100]."""
    if isinstance(value, bool):
        raise ConfigError(f"percentage must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        pct = float(value)
    else:
        match = _PERCENT.match(str(value))
        if match is None:
            raise ConfigError(f"cannot read percentage {value!r}: write e.g. '1%' or '0.5'")
        pct = float(match.group(1))
    if not math.isfinite(pct) or not 0 <= pct <= 100:
        raise ConfigError(f"percentage must be between 0 and 100, got {value!r}")
    return pct


@dataclass(frozen=True)
class LinkConfig:
    """An emulated link from the prefill host ``{prefix}-tx`` to ``hosts`` decode hosts.

    ``hosts`` 1 (the default): two namespaces ``{prefix}-tx`` and ``{prefix}-rx`` joined
    by a veth pair. ``hosts`` K > 1: decode namespaces ``{prefix}-rx0`` ...
    ``{prefix}-rx{K-1}``, each joined with the prefill namespace through a bridge in a
    namespace ``{prefix}-sw`` of its own (see :mod:`lynx_bench.netem.link`); the prefill's
    one veth carries its traffic to every decode host, so one htb there holds the sum
    to the rate.

    ``rate_gbps`` shapes every host's egress (htb). ``delay_ms``/``jitter_ms``/``loss_pct``
    need the kernel's netem qdisc; asking for them where it is missing is an error
    when the link comes up (never silently ignored). ``lanes`` > 0 adds one htb class
    per lane, lane 0 first in priority, matched by the lane's TCP port range (both
    source and destination port) — give each lane's UCX worker that range with
    ``UCX_TCP_PORT_RANGE``. Every namespace reserves the lane ports
    (``ip_local_reserved_ports``), so no port the kernel picks for another socket
    falls in a lane. ``burst_bytes`` None picks 1 ms at the rate (at least
    128 KiB, so one full GSO packet fits). ``subnet`` None picks 10.254.0.0/30 for
    one decode host and 10.254.0.0/27 for more; a subnet must hold ``hosts`` + 1
    addresses (the prefill host takes the first, decode host ``i`` the ``i+2``-th).
    """

    rate_gbps: float
    prefix: str = "lynx"
    subnet: str | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    lanes: int = 0
    lane_port_base: int = 40960
    lane_port_block: int = 256
    burst_bytes: int | None = None
    hosts: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.rate_gbps, bool) or not isinstance(self.rate_gbps, (int, float)):
            raise ConfigError(f"rate_gbps must be a number, got {self.rate_gbps!r}")
        _check_rate("rate", float(self.rate_gbps))
        if not isinstance(self.prefix, str) or not _PREFIX.match(self.prefix):
            raise ConfigError(f"prefix {self.prefix!r} must be 1-12 characters of a-z, 0-9 "
                              "and '-', starting with a letter (it names namespaces and devices)")
        _check_int("hosts", self.hosts, 1, MAX_HOSTS)
        if self.hosts > 1:
            longest = self.device(Host(Side.RX, self.hosts - 1))
            if len(longest) > _IFNAMSIZ:
                raise ConfigError(
                    f"prefix {self.prefix!r} is too long for {self.hosts} hosts: device "
                    f"{longest!r} would pass the kernel's {_IFNAMSIZ} characters; use a prefix "
                    f"of at most {_IFNAMSIZ - len(longest) + len(self.prefix)} characters")
        try:
            net = ipaddress.ip_network(self._subnet, strict=True)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"subnet {self.subnet!r} is not a network: {exc}") from exc
        if net.version != 4 or net.prefixlen > 30 or not net.is_private:
            raise ConfigError(f"subnet {self.subnet!r} must be a private IPv4 network "
                              "of /30 or larger")
        if net.num_addresses - 2 < self.hosts + 1:
            raise ConfigError(f"subnet {self._subnet} has room for {net.num_addresses - 2} "
                              f"hosts, not the {self.hosts + 1} of 1 prefill and {self.hosts} "
                              f"decode hosts; give a larger one (e.g. {_SUBNET_MANY}) or none")
        for name in ("delay_ms", "jitter_ms", "loss_pct"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if self.loss_pct > 100:
            raise ConfigError(f"loss_pct must be at most 100, got {self.loss_pct!r}")
        if self.jitter_ms > 0 and self.delay_ms == 0:
            raise ConfigError("jitter needs a delay (jitter varies the delay)")
        _check_int("lanes", self.lanes, 0, 8)
        block = self.lane_port_block
        _check_int("lane_port_block", block, 16, 4096)
        if block & (block - 1):
            raise ConfigError(f"lane_port_block must be a power of two, got {block}")
        _check_int("lane_port_base", self.lane_port_base, 1024, 65535)
        if self.lane_port_base % block:
            raise ConfigError(f"lane_port_base {self.lane_port_base} must be a multiple of "
                              f"lane_port_block {block} (so one u32 mask matches a lane)")
        if self.lane_port_base + self.lanes * block - 1 > 65535:
            raise ConfigError("lane port ranges run past port 65535")
        if self.burst_bytes is not None:
            _check_int("burst_bytes", self.burst_bytes, 1600, 1 << 30)

    @property
    def wants_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def burst(self) -> int:
        """htb burst in bytes."""
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(128 * 1024, int(self.rate_gbps * 1e9 / 8 * 1e-3))

    # -- hosts and their names ----------------------------------------------------

    @property
    def switched(self) -> bool:
        """Whether the hosts meet on a bridge (``hosts`` > 1) rather than one veth pair."""
        return self.hosts > 1

    @property
    def prefill_host(self) -> Host:
        return Host(Side.TX, 0)

    @property
    def decode_hosts(self) -> tuple[Host, ...]:
        return tuple(Host(Side.RX, i) for i in range(self.hosts))

    @property
    def all_hosts(self) -> tuple[Host, ...]:
        """The prefill host, then the decode hosts in order."""
        return (self.prefill_host, *self.decode_hosts)

    def host(self, ref: HostRef, index: int | None = None) -> Host:
        """The host that ``ref`` (and, for a side, ``index``) names on this link.

        ``"rx"`` / ``Side.RX`` without an index names the only decode host; where
        there are several it is a :class:`ConfigError` (say which: ``("rx", i)``,
        ``"rx<i>"`` or ``decode_hosts[i]``), as is an index out of range."""
        digits: str | None = None
        if isinstance(ref, Host):
            side, digits = ref.side, str(ref.index)
        elif isinstance(ref, Side):
            side = ref
        elif isinstance(ref, str) and (match := _HOST_NAME.match(ref)) is not None:
            side, digits = Side(match.group(1)), match.group(2)
        else:
            raise ConfigError(f"no host {ref!r}: name one as 'tx', 'rx', 'rx<i>', a Side or a Host")
        if digits is not None:
            if index is not None:
                raise ConfigError(f"{ref!r} already names its host; give no index ({index!r})")
            index = int(digits)
        if side is Side.TX:
            if index not in (None, 0):
                raise ConfigError(f"there is one prefill host (tx), not tx {index!r}")
            return self.prefill_host
        if index is None:
            if self.hosts > 1:
                raise ConfigError(f"this link has {self.hosts} decode hosts; say which: "
                                  f"('rx', i), 'rx<i>' or decode_hosts[i] with i in "
                                  f"[0, {self.hosts})")
            index = 0
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.hosts:
            raise ConfigError(f"decode host index must be in [0, {self.hosts}), got {index!r}")
        return Host(Side.RX, index)

    def host_name(self, ref: HostRef, index: int | None = None) -> str:
        """``"tx"``; ``"rx"`` for the only decode host, ``"rx<i>"`` where there are several."""
        host = self.host(ref, index)
        if host.side is Side.TX or not self.switched:
            return host.side.value
        return f"{host.side.value}{host.index}"

    def namespace(self, ref: HostRef, index: int | None = None) -> str:
        return f"{self.prefix}-{self.host_name(ref, index)}"

    def device(self, ref: HostRef, index: int | None = None) -> str:
        """The veth device inside the host's namespace (named like the namespace)."""
        return self.namespace(ref, index)

    @property
    def switch_namespace(self) -> str:
        """The namespace holding the bridge (only created where ``hosts`` > 1)."""
        return f"{self.prefix}-sw"

    def switch_port(self, ref: HostRef, index: int | None = None) -> str:
        """The bridge port, in the switch namespace, that is the peer of the host's veth."""
        return self.host_name(ref, index)

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace this link creates, in the order of :func:`owned_namespaces`."""
        names = tuple(self.namespace(h) for h in self.all_hosts)
        return (*names, self.switch_namespace) if self.switched else names

    # -- addresses -------------------------------------------------------------------

    @property
    def _subnet(self) -> str:
        if self.subnet is not None:
            return self.subnet
        return _SUBNET_ONE if self.hosts == 1 else _SUBNET_MANY

    @property
    def network(self) -> ipaddress.IPv4Network:
        """The subnet, with the default filled in."""
        net = ipaddress.ip_network(self._subnet)
        assert isinstance(net, ipaddress.IPv4Network)  # checked in __post_init__
        return net

    def address(self, ref: HostRef, index: int | None = None) -> str:
        """The host's IPv4 address: the prefill host has the subnet's first, decode
        host ``i`` the ``i+2``-th (so with one decode host: tx first, rx second)."""
        host = self.host(ref, index)
        return str(self.network.network_address + (1 if host.side is Side.TX else 2 + host.index))

    @property
    def prefixlen(self) -> int:
        return self.network.prefixlen

    def lane_ports(self, lane: int) -> PortRange:
        """The TCP port range of ``lane`` (0 = highest priority)."""
        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self.lanes:
            raise ConfigError(f"lane must be in [0, {self.lanes}), got {lane!r}")
        low = self.lane_port_base + lane * self.lane_port_block
        return PortRange(low, low + self.lane_port_block - 1)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
