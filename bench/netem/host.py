"""The one place that runs ``ip`` and ``tc`` (iproute2) for link emulation.

Every failure — a missing tool, a non-zero exit, a timeout — becomes a
:class:`LinkError` naming the command and quoting its stderr. Commands are logged
at DEBUG level (``lynx --log-level debug link up ...`` shows exactly what ran).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from lynx_bench.common.errors import LinkError

__all__ = [
    "require_root",
    "sh",
    "namespaces",
    "netns_pids",
    "netem_available",
    "delete_namespace",
    "wait_carrier",
    "wait_forwarding",
]

_log = logging.getLogger("lynx_bench.netem.link")

ROOT_HINT = ("link emulation with network namespaces and tc needs root and iproute2 "
             "(`ip`, `tc`); run as root, or use `--link shaper` (the transport's "
             "in-process token-bucket shaper, no root needed)")


def require_root() -> None:
    """Raise :class:`LinkError` (pointing to ``--link shaper``) unless we can run ip/tc as root."""
    if os.geteuid() != 0:
        raise LinkError(f"not running as root: {ROOT_HINT}")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"{', '.join(missing)} not found: {ROOT_HINT}")


def sh(argv: Sequence[str], *, check: bool = True,
       timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    """Run one iproute2 command; raise :class:`LinkError` on failure when ``check``."""
    cmd = " ".join(argv)
    _log.debug("run: %s", cmd)
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except FileNotFoundError as exc:
        raise LinkError(f"`{argv[0]}` not found: {ROOT_HINT}") from exc
    except subprocess.TimeoutExpired as exc:
        raise LinkError(f"`{cmd}` did not finish within {timeout:g} s") from exc
    if check and proc.returncode != 0:
        raise LinkError(f"`{cmd}` failed (exit {proc.returncode}): "
                        f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def namespaces() -> set[str]:
    """Names of the network namespaces that exist (``ip netns list``)."""
    out = sh(["ip", "-j", "netns", "list"]).stdout.strip()
    if not out:
        return set()
    try:
        return {entry["name"] for entry in json.loads(out)}
    except (ValueError, KeyError, TypeError) as exc:
        raise LinkError(f"cannot read `ip -j netns list` output: {out[:200]!r}") from exc


def netns_pids(namespace: str) -> list[int]:
    """Processes running inside ``namespace``."""
    out = sh(["ip", "netns", "pids", namespace]).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def delete_namespace(namespace: str, grace_s: float = 2.0) -> None:
    """End the processes still inside ``namespace`` (SIGTERM, then SIGKILL after
    ``grace_s``), then delete it, which destroys its devices. A process left
    running there would keep the namespace, and the veth in it, alive."""
    pids = netns_pids(namespace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            _log.debug("sending %s to pid %d in %s", sig.name, pid, namespace)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            pids = netns_pids(namespace)
        if not pids:
            break
    if pids:
        raise LinkError(f"processes {pids} in namespace {namespace} survived SIGKILL")
    sh(["ip", "netns", "delete", namespace])


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has the netem qdisc: try to attach one to the loopback
    device of a throwaway namespace (the answer is cached per process)."""
    require_root()
    probe = f"lynx-probe-{os.getpid()}"
    try:  # entered before the namespace exists: an interrupted `add` is cleaned up too
        sh(["ip", "netns", "add", probe])
        proc = sh(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
                   "delay", "1ms"], check=False)
        if proc.returncode == 0:
            return True
        if "unknown" in proc.stderr.lower():  # "Specified qdisc kind is unknown."
            return False
        raise LinkError(f"probing for netem failed: {proc.stderr.strip()}")
    finally:
        if probe in namespaces():
            sh(["ip", "netns", "delete", probe])


def wait_carrier(namespace: str, device: str, timeout: float = 5.0) -> float:
    """Wait until ``device`` in ``namespace`` reports operstate ``UP``; return the seconds waited.

    ``ip link set dev up`` returns before the kernel's link watcher marks the veth's
    carrier on (up to about a second later), and until then UCX's tcp transport
    skips the device ("No such device"). Raises :class:`LinkError` after ``timeout``.
    """
    return _wait_link(namespace, device, timeout, bridge_port=False)


def wait_forwarding(namespace: str, port: str, timeout: float = 5.0) -> float:
    """Wait until bridge port ``port`` in ``namespace`` is ``UP`` and in the bridge's
    ``forwarding`` state (immediately after carrier with STP off, the bridge's
    default); return the seconds waited. Raises :class:`LinkError` after ``timeout``."""
    return _wait_link(namespace, port, timeout, bridge_port=True)


def _wait_link(namespace: str, device: str, timeout: float, *, bridge_port: bool) -> float:
    start = time.monotonic()
    argv = ["ip", "-n", namespace, "-j", *(["-d"] if bridge_port else []), "link", "show",
            "dev", device]
    while True:
        out = sh(argv).stdout
        try:
            info = json.loads(out)[0]
            state = str(info.get("operstate", "?"))
            if bridge_port:
                port = info.get("linkinfo", {}).get("info_slave_data", {})
                state += f", port {port.get('state', 'not on a bridge')}"
        except (ValueError, IndexError, TypeError, AttributeError) as exc:
            raise LinkError(f"cannot read `{' '.join(argv)}` output: {out[:200]!r}") from exc
        waited = time.monotonic() - start
        if state == ("UP, port forwarding" if bridge_port else "UP"):
            return waited
        if waited >= timeout:
            raise LinkError(f"{device} in namespace {namespace} is still {state} "
                            f"{timeout:g} s after it was set up")
        time.sleep(0.01)
