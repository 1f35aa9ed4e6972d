"""What an emulated link looks like right now, read back from the kernel
(namespaces, addresses, qdiscs, htb classes, the bridge and its ports) — no state
file, so ``lynx link show`` reports the truth even for a link another process set
up, and finds its number of hosts from the namespaces and bridge ports it sees."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from lynx_bench.common.errors import LinkError

from .config import BRIDGE, MAX_HOSTS, Side, owned_namespaces
from .host import namespaces, sh

__all__ = ["QdiscInfo", "ClassInfo", "SideStatus", "SwitchStatus", "LinkStatus", "inspect_link",
           "htb_sent_bytes"]


@dataclass(frozen=True)
class QdiscInfo:
    kind: str
    handle: str
    parent: str  # "root" or a class id
    options: str  # tc's own words, e.g. "delay 10ms loss 1%"


@dataclass(frozen=True)
class ClassInfo:
    handle: str
    parent: str
    prio: int
    rate_gbps: float
    ceil_gbps: float


@dataclass(frozen=True)
class SideStatus:
    side: Side
    namespace: str
    present: bool
    device: str
    state: str  # operstate, "" when the device is missing
    addresses: tuple[str, ...]  # CIDR
    qdiscs: tuple[QdiscInfo, ...]
    classes: tuple[ClassInfo, ...]
    index: int = 0  # the decode host's number; 0 for tx
    host: str = ""  # "tx", "rx" or "rx<i>"

    @property
    def rate_gbps(self) -> float | None:
        """The root htb class's rate (the link rate in this direction)."""
        roots = [c for c in self.classes if c.parent == "root"]
        return roots[0].rate_gbps if roots else None


@dataclass(frozen=True)
class SwitchStatus:
    """The switch namespace of a link with several decode hosts."""

    namespace: str
    present: bool
    bridge: str
    state: str  # the bridge's operstate, "" when it is missing
    ports: tuple[str, ...]  # devices on the bridge: "tx", "rx0", ...

    @property
    def up(self) -> bool:
        return self.present and self.state == "UP"


@dataclass(frozen=True)
class LinkStatus:
    """``sides``: the prefill host (tx) first, then each decode host in order."""

    prefix: str
    sides: tuple[SideStatus, ...]
    netem_available: bool | None  # None: not probed
    switch: SwitchStatus | None = None  # None: a two-namespace link (one decode host)

    @property
    def hosts(self) -> int:
        """How many decode hosts the link has (or had, where it is partly gone)."""
        return sum(1 for s in self.sides if s.side is Side.RX)

    @property
    def up(self) -> bool:
        return (self.hosts > 0
                and all(s.present and s.state in ("UP", "UNKNOWN") for s in self.sides)
                and (self.switch is None or self.switch.up))

    @property
    def present(self) -> bool:
        return any(s.present for s in self.sides) or (self.switch is not None
                                                      and self.switch.present)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["up"] = self.up
        out["hosts"] = self.hosts
        for side, raw in zip(self.sides, out["sides"]):
            raw["side"] = side.side.value
            raw["rate_gbps"] = side.rate_gbps
        return out


_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TC_RATE = re.compile(r"^([0-9.]+)([a-z]*)$", re.IGNORECASE)
_CLASS = re.compile(r"^class htb (\S+) (?:parent (\S+)|root)(?: leaf \S+)?(?: prio (\d+))? "
                    r"rate (\S+) ceil (\S+)")


def _tc_gbps(text: str) -> float:
    match = _TC_RATE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise LinkError(f"cannot read tc rate {text!r}")
    return float(match.group(1)) * _UNITS[unit] / 1e9


def _classes(namespace: str, device: str) -> tuple[ClassInfo, ...]:
    # iproute2 6.1 prints htb classes as text even with -j
    out = sh(["tc", "-n", namespace, "class", "show", "dev", device]).stdout
    classes = []
    for line in out.splitlines():
        if (match := _CLASS.match(line.strip())) is not None:
            handle, parent, prio, rate, ceil = match.groups()
            classes.append(ClassInfo(handle, parent or "root", int(prio or 0), _tc_gbps(rate),
                                     _tc_gbps(ceil)))
    return tuple(classes)


def _qdiscs(namespace: str, device: str) -> tuple[QdiscInfo, ...]:
    out = sh(["tc", "-n", namespace, "-j", "qdisc", "show", "dev", device]).stdout
    qdiscs = []
    for q in json.loads(out or "[]"):
        options = q.get("options", {})
        words = " ".join(f"{k} {v}" for k, v in options.items() if not isinstance(v, (dict, list)))
        parent = "root" if q.get("root") else str(q.get("parent", ""))
        qdiscs.append(QdiscInfo(str(q.get("kind")), str(q.get("handle")), parent, words))
    return tuple(qdiscs)


def _side(namespace: str, side: Side, index: int, host: str, existing: set[str]) -> SideStatus:
    device = namespace
    if namespace not in existing:
        return SideStatus(side, namespace, False, device, "", (), (), (), index, host)
    proc = sh(["ip", "-n", namespace, "-j", "addr", "show", "dev", device], check=False)
    if proc.returncode != 0:  # namespace without our device (half set up)
        return SideStatus(side, namespace, True, device, "", (), (), (), index, host)
    links = json.loads(proc.stdout or "[]")
    info = links[0] if links else {}
    addresses = tuple(f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", [])
                      if a.get("family") == "inet")
    return SideStatus(side, namespace, True, device, str(info.get("operstate", "")), addresses,
                      _qdiscs(namespace, device), _classes(namespace, device), index, host)


def _switch(namespace: str, existing: set[str]) -> SwitchStatus:
    if namespace not in existing:
        return SwitchStatus(namespace, False, BRIDGE, "", ())
    proc = sh(["ip", "-n", namespace, "-j", "link", "show", "dev", BRIDGE], check=False)
    if proc.returncode != 0:  # namespace without its bridge (half set up)
        return SwitchStatus(namespace, True, BRIDGE, "", ())
    state = str((json.loads(proc.stdout or "[]") or [{}])[0].get("operstate", ""))
    out = sh(["ip", "-n", namespace, "-j", "link", "show", "master", BRIDGE]).stdout
    ports = tuple(sorted((str(p["ifname"]) for p in json.loads(out or "[]")),
                         key=lambda name: (len(name), name)))
    return SwitchStatus(namespace, True, BRIDGE, state, ports)


def inspect_link(prefix: str, netem_available: bool | None = None) -> LinkStatus:
    """Read the link named ``prefix`` back from the kernel (needs root for the
    per-namespace details; absent namespaces are reported as not present).

    A link with several decode hosts is recognised by its switch namespace or its
    numbered decode namespaces; its hosts are those namespaces and the bridge's
    ports, so a host that has gone missing shows as absent (and the link as not up).
    Where nothing is there, the status is that of an absent two-namespace link."""
    existing = namespaces()
    suffixes = [ns[len(prefix) + 1:] for ns in owned_namespaces(prefix, existing)]
    numbered = {int(s[2:]) for s in suffixes if s[2:].isdigit()}  # rx<i>
    tx = _side(f"{prefix}-tx", Side.TX, 0, "tx", existing)
    if "sw" not in suffixes and not numbered:
        rx = _side(f"{prefix}-rx", Side.RX, 0, "rx", existing)
        return LinkStatus(prefix, (tx, rx), netem_available)
    switch = _switch(f"{prefix}-sw", existing)
    indices = numbered | {int(p[2:]) for p in switch.ports
                          if p.startswith("rx") and p[2:].isdigit() and int(p[2:]) < MAX_HOSTS}
    count = max(indices) + 1 if indices else 0
    decode = tuple(_side(f"{prefix}-rx{i}", Side.RX, i, f"rx{i}", existing) for i in range(count))
    return LinkStatus(prefix, (tx, *decode), netem_available, switch)


_SENT = re.compile(r"^\s*Sent (\d+) bytes", re.MULTILINE)


def htb_sent_bytes(namespace: str, device: str, classid: str = "1:1") -> int:
    """Bytes the htb class ``classid`` on ``device`` has let out so far (frames as tc
    counts them: IP packet plus Ethernet header, each GSO segment counted)."""
    out = sh(["tc", "-s", "-n", namespace, "class", "show", "dev", device,
              "classid", classid]).stdout
    match = _SENT.search(out)
    if match is None:
        raise LinkError(f"no htb class {classid} on {device} in {namespace}: {out[:200]!r}")
    return int(match.group(1))
