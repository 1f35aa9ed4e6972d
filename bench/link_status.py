"""What an emulated link looks like right now, read back from the kernel
(namespaces, addresses, qdiscs, htb classes) — no state file, so ``lynx link show``
reports the truth even for a link another process set up."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from lynx_transport.errors import LinkError

from .link_config import Side
from .link_sys import namespaces, sh

__all__ = ["QdiscInfo", "ClassInfo", "SideStatus", "LinkStatus", "inspect_link"]


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

    @property
    def rate_gbps(self) -> float | None:
        """The root htb class's rate (the link rate in this direction)."""
        roots = [c for c in self.classes if c.parent == "root"]
        return roots[0].rate_gbps if roots else None


@dataclass(frozen=True)
class LinkStatus:
    prefix: str
    sides: tuple[SideStatus, ...]
    netem_available: bool | None  # None: not probed

    @property
    def up(self) -> bool:
        return all(s.present and s.state in ("UP", "UNKNOWN") for s in self.sides)

    @property
    def present(self) -> bool:
        return any(s.present for s in self.sides)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["up"] = self.up
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


def _side(prefix: str, side: Side, existing: set[str]) -> SideStatus:
    namespace = device = f"{prefix}-{side.value}"
    if namespace not in existing:
        return SideStatus(side, namespace, False, device, "", (), (), ())
    proc = sh(["ip", "-n", namespace, "-j", "addr", "show", "dev", device], check=False)
    if proc.returncode != 0:  # namespace without our device (half set up)
        return SideStatus(side, namespace, True, device, "", (), (), ())
    links = json.loads(proc.stdout or "[]")
    info = links[0] if links else {}
    addresses = tuple(f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", [])
                      if a.get("family") == "inet")
    return SideStatus(side, namespace, True, device, str(info.get("operstate", "")), addresses,
                      _qdiscs(namespace, device), _classes(namespace, device))


def inspect_link(prefix: str, netem_available: bool | None = None) -> LinkStatus:
    """Read the link named ``prefix`` back from the kernel (needs root for the
    per-namespace details; absent namespaces are reported as not present)."""
    existing = namespaces()
    return LinkStatus(prefix, tuple(_side(prefix, s, existing) for s in Side), netem_available)
