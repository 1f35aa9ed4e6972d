"""An emulated network link: namespaces joined by veth pairs, shaped with tc.

One decode host (``hosts`` 1, the default) — two namespaces and one veth pair::

    {prefix}-tx namespace                      {prefix}-rx namespace
    dev {prefix}-tx  10.254.0.1/30  <== veth ==>  10.254.0.2/30  dev {prefix}-rx
    egress: htb rate R                            egress: htb rate R

K decode hosts (``hosts`` K > 1) — a switch namespace with a bridge, one veth pair
per host::

    {prefix}-tx   dev {prefix}-tx  10.254.0.1/27   egress: htb rate R  (all prefill traffic)
                        ||
    {prefix}-sw   bridge br, ports tx, rx0 ... rx{K-1}   (no addresses, unshaped)
                        ||
    {prefix}-rx<i> dev {prefix}-rx<i>  10.254.0.<i+2>/27   egress: htb rate R  (each host)

The bridge has a namespace of its own, not the prefill's, so the prefill host has
exactly one device, its veth, and everything it sends to any decode host leaves
through that veth's egress: one htb there holds the *sum* over all decode hosts to
the rate, as one NIC of rate R would. (A bridge inside the prefill namespace would
need the htb on the bridge device, and any qdisc on its per-host ports would shape
each host separately instead.) Each decode host's egress is shaped at R too, like
its own NIC; what the K of them send back together (acks, control frames) is not
held to R at the prefill's ingress. Decode-to-decode traffic crosses the bridge
without meeting the prefill's htb. The bridge runs without STP, so a port forwards
as soon as its carrier is on; :meth:`Link.up` waits for that.

Every shaped egress has an htb root class ``1:1`` at the rate and a default leaf
``1:99``. With ``lanes`` > 0 each lane gets a leaf ``1:1<i>`` (hex class ids
``1:10``, ``1:11``, ...) with htb priority ``i`` — lane 0 is served first and the
others only use what it leaves — matched by u32 filters on the lane's TCP port
range as TCP source *or* destination port, so the network itself enforces anchor
priority as long as each lane's UCX worker uses its range
(:meth:`Link.ucx_env`). Unmatched traffic (handshakes, control) goes to ``1:99``
at priority 0. netem (delay/jitter/loss) is attached under each leaf when asked
for, and only if the kernel has it: otherwise :meth:`Link.up` raises
:class:`LinkError` before creating anything.

Nothing is routed outside the link's namespaces: the root namespace is untouched.

Lifetime: ``with Link(config) as link:`` brings the link up and always tears it
down (also on errors and Ctrl-C, which arrives as ``KeyboardInterrupt``);
:func:`teardown` (``lynx link down``) is idempotent and also removes a link some
other process left behind, whatever its number of hosts. Processes started with
:meth:`Link.popen_in` are ended on teardown, as is anything else still running
inside the namespaces. Threads: a ``Link`` is not thread-safe; use it from one thread.

Usage::

    with Link(LinkConfig(rate_gbps=1.0)) as link:
        receiver = link.popen_in("rx", [sys.executable, "-m", "my.receiver"])
        link.run_in("tx", [sys.executable, "-m", "my.sender", link.address("rx")])

    with Link(LinkConfig(rate_gbps=1.0, hosts=3)) as link:
        for host in link.decode_hosts:  # or ("rx", i), or "rx<i>"
            link.popen_in(host, [...], env={**os.environ, **link.ucx_env(host)})
        link.run_in("tx", [..., *(link.address(h) for h in link.decode_hosts)])
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from lynx_bench.common.errors import LinkError

from .config import BRIDGE, Host, HostRef, LinkConfig, PortRange, owned_namespaces
from .host import (
    delete_namespace,
    namespaces,
    netem_available,
    require_root,
    sh,
    wait_carrier,
    wait_forwarding,
)
from .status import LinkStatus, inspect_link

__all__ = ["Link", "teardown", "DEFAULT_CLASS", "lane_class"]

_log = logging.getLogger("lynx_bench.netem.link")

DEFAULT_CLASS = "1:99"
_QUANTUM = 65536  # bytes per DRR round: one full GSO packet


def lane_class(lane: int) -> str:
    """The htb class id of ``lane`` (hex minor numbers, as tc reads them)."""
    return f"1:{0x10 + lane:x}"


def teardown(prefix: str) -> list[str]:
    """Remove the link named ``prefix``, whatever its number of hosts: end the
    processes inside its namespaces and delete them (which destroys the veth pairs,
    the bridge and the qdiscs). Only namespaces named as a link's are touched
    (:func:`~lynx_bench.netem.config.owned_namespaces`). Idempotent: returns the
    namespaces it removed, ``[]`` when there was nothing to remove."""
    present = owned_namespaces(prefix, namespaces())
    if present:
        require_root()
    for ns in present:
        delete_namespace(ns)
    return present


class Link:
    """An emulated link described by a :class:`LinkConfig` (see the module docstring)."""

    def __init__(self, config: LinkConfig) -> None:
        self._config = config
        self._children: list[subprocess.Popen[Any]] = []
        self._up = False

    @property
    def config(self) -> LinkConfig:
        return self._config

    # -- lifetime -----------------------------------------------------------------

    def up(self) -> Link:
        """Create namespaces, veth pairs (and the bridge), addresses and qdiscs; return
        once every host's veth reports carrier (UCX's tcp transport skips a device
        without it) and every bridge port forwards.

        Raises :class:`LinkError` when not root, when delay/loss/jitter are asked for
        and the kernel has no netem, when any namespace of a link with this prefix
        already exists (of any number of hosts), or when any ip/tc command fails —
        after removing whatever it had created.
        """
        cfg = self._config
        require_root()
        if cfg.wants_netem and not netem_available():
            raise LinkError(
                "this kernel has no netem qdisc (sch_netem), so delay, jitter and loss "
                "cannot be emulated; only the rate can (htb). Drop --delay/--jitter/--loss, "
                "or use a kernel with netem. Nothing was set up.")
        existing = owned_namespaces(cfg.prefix, namespaces())
        if existing:
            raise LinkError(f"namespaces {', '.join(existing)} already exist; run "
                            f"`lynx link down --prefix {cfg.prefix}` first")
        try:
            self._create()
        except BaseException:
            _log.debug("setting up link %s failed; tearing down", cfg.prefix)
            teardown(cfg.prefix)
            raise
        self._up = True
        return self

    def down(self) -> list[str]:
        """End the processes this link started, then :func:`teardown`. Idempotent."""
        for child in self._children:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
        self._children.clear()
        self._up = False
        return teardown(self._config.prefix)

    def __enter__(self) -> Link:
        return self if self._up else self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()

    def _create(self) -> None:
        cfg = self._config
        for ns in cfg.namespaces:
            sh(["ip", "netns", "add", ns])
            if cfg.lanes:
                # the filters match a lane by source or destination port: an ephemeral
                # port the kernel picks inside a lane's range (32768-60999 holds them)
                # would put another connection's bytes in that lane's class
                ports = f"{cfg.lane_ports(0).low}-{cfg.lane_ports(cfg.lanes - 1).high}"
                sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                    f"net.ipv4.ip_local_reserved_ports={ports}"])
        if cfg.switched:
            sw = cfg.switch_namespace
            sh(["ip", "-n", sw, "link", "add", "name", BRIDGE, "type", "bridge"])  # STP off
            sh(["ip", "-n", sw, "link", "set", "dev", BRIDGE, "up"])
            for host in cfg.all_hosts:
                port = cfg.switch_port(host)
                sh(["ip", "-n", cfg.namespace(host), "link", "add", "name", cfg.device(host),
                    "type", "veth", "peer", "name", port, "netns", sw])
                sh(["ip", "-n", sw, "link", "set", "dev", port, "master", BRIDGE])
                sh(["ip", "-n", sw, "link", "set", "dev", port, "up"])
        else:
            tx, rx = cfg.prefill_host, cfg.decode_hosts[0]
            sh(["ip", "-n", cfg.namespace(tx), "link", "add", cfg.device(tx), "type", "veth",
                "peer", "name", cfg.device(rx), "netns", cfg.namespace(rx)])
        for host in cfg.all_hosts:
            ns, dev = cfg.namespace(host), cfg.device(host)
            sh(["ip", "-n", ns, "addr", "add", f"{cfg.address(host)}/{cfg.prefixlen}",
                "dev", dev])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            sh(["ip", "-n", ns, "link", "set", dev, "up"])
            self._shape(ns, dev)
        for host in cfg.all_hosts:  # UCX's tcp transport only lists devices whose carrier is on
            wait_carrier(cfg.namespace(host), cfg.device(host))
        if cfg.switched:  # and the first frames must not meet a port that drops them
            for host in cfg.all_hosts:
                wait_forwarding(cfg.switch_namespace, cfg.switch_port(host))

    def _shape(self, ns: str, dev: str) -> None:
        cfg = self._config
        rate = round(cfg.rate_gbps * 1e9)
        burst = str(cfg.burst)

        def tc(*args: str) -> None:
            sh(["tc", "-n", ns, *args])

        def leaf(classid: str, assured: int, prio: int) -> None:
            tc("class", "add", "dev", dev, "parent", "1:1", "classid", classid, "htb",
               "rate", f"{assured}bit", "ceil", f"{rate}bit", "burst", burst,
               "cburst", burst, "prio", str(prio), "quantum", str(_QUANTUM))
            if cfg.wants_netem:
                netem = ["delay", f"{cfg.delay_ms}ms"]
                if cfg.jitter_ms:
                    netem.append(f"{cfg.jitter_ms}ms")
                if cfg.loss_pct:
                    netem += ["loss", f"{cfg.loss_pct}%"]
                tc("qdisc", "add", "dev", dev, "parent", classid, "netem", *netem,
                   "limit", "100000")

        tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
           "default", DEFAULT_CLASS.split(":")[1])
        tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
           "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", burst, "cburst", burst,
           "quantum", str(_QUANTUM))
        if cfg.lanes == 0:
            leaf(DEFAULT_CLASS, rate, 0)
            return
        # every class is assured a sliver; lane 0 gets the rest and borrows first
        sliver = max(8, rate // 100)
        leaf(DEFAULT_CLASS, sliver, 0)
        for lane in range(cfg.lanes):
            assured = rate - cfg.lanes * sliver if lane == 0 else sliver
            leaf(lane_class(lane), assured, lane)
            ports = cfg.lane_ports(lane)
            for field in ("sport", "dport"):
                tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                   "u32", "match", "ip", "protocol", "6", "0xff",  # TCP only
                   "match", "ip", field, str(ports.low), f"0x{ports.mask:04x}",
                   "flowid", lane_class(lane))

    # -- where things are ---------------------------------------------------------

    @property
    def prefill_host(self) -> Host:
        return self._config.prefill_host

    @property
    def decode_hosts(self) -> tuple[Host, ...]:
        """The decode hosts, in order (one for a two-namespace link)."""
        return self._config.decode_hosts

    def host(self, ref: HostRef, index: int | None = None) -> Host:
        """The :class:`Host` that ``ref`` names (see :meth:`LinkConfig.host`)."""
        return self._config.host(ref, index)

    def namespace(self, host: HostRef, index: int | None = None) -> str:
        return self._config.namespace(host, index)

    def device(self, host: HostRef, index: int | None = None) -> str:
        return self._config.device(host, index)

    def address(self, host: HostRef, index: int | None = None) -> str:
        """The IPv4 address of a host: ``address("tx")``, ``address("rx")`` (one decode
        host), ``address("rx", i)`` or ``address(link.decode_hosts[i])``."""
        return self._config.address(host, index)

    def lane_ports(self, lane: int) -> PortRange:
        return self._config.lane_ports(lane)

    def ucx_env(self, host: HostRef, lane: int | None = None) -> dict[str, str]:
        """Environment for a UCX (ucxx) process on ``host``: tcp only, on its veth, and,
        for a ``lane``, that lane's port range for the worker's data connections.

        Pinning the transport and device keeps shared memory or another device from
        ever bypassing the shaped link. A UCX context given ``TLS``/``NET_DEVICES``
        in its config overrides these variables; ``UCX_TCP_PORT_RANGE`` still
        applies. What was checked: docs/design.md, "Link emulation"."""
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.device(host)}
        if lane is not None:
            env["UCX_TCP_PORT_RANGE"] = self.lane_ports(lane).ucx
        return env

    def status(self) -> LinkStatus:
        return inspect_link(self._config.prefix)

    # -- running things inside --------------------------------------------------

    def exec_argv(self, host: HostRef, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``'s namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen_in(self, host: HostRef, argv: Sequence[str],
                 **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; it is ended by :meth:`down`."""
        child = subprocess.Popen(self.exec_argv(host, argv), **kwargs)
        self._children.append(child)
        return child

    def run_in(self, host: HostRef, argv: Sequence[str],
               **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``host``'s namespace to completion (``subprocess.run``)."""
        return subprocess.run(self.exec_argv(host, argv), check=False, **kwargs)
