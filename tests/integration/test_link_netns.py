"""Real link emulation: namespaces, veth, bridge, htb — driven through the ``lynx``
command and the :class:`~lynx_bench.netem.link.Link` API.

Needs root and iproute2 (tests/conftest.py skips with the reason otherwise). Every
test uses its own prefix and removes its namespaces (any number of hosts) in a
finalizer, also when it fails; the finalizer then asserts that nothing is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import lynx_bench.netem.link
from lynx_bench.common.errors import LinkError
from lynx_bench.netem.config import LinkConfig, owned_namespaces
from lynx_bench.netem.host import namespaces, netem_available
from lynx_bench.netem.link import Link, teardown

pytestmark = pytest.mark.netns

LYNX = Path(sys.executable).with_name("lynx")
# Both ends of every bulk transfer run SCHED_FIFO: the tests measure the link, not
# the scheduler of a shared 2-core machine (unprioritised ends dropped to 0.87 of
# the rate there under other load).
BULK = ["chrt", "--fifo", "20", sys.executable, "-m", "lynx_bench.netem.bulk"]


def lynx(*argv: str) -> subprocess.CompletedProcess[str]:
    assert LYNX.exists(), f"the lynx entry point is not installed next to {sys.executable}"
    return subprocess.run([str(LYNX), *argv], capture_output=True, text=True, timeout=60,
                          check=False)


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {entry["ifname"] for entry in json.loads(out)}


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"lt{os.getpid() % 100000}{request.node.name[5:8]}".lower()
    name = "".join(c for c in name if c.isalnum())[:10]
    assert not owned_namespaces(name, namespaces()), f"namespaces of {name} exist before the test"
    before = root_links()
    try:
        yield name
    finally:
        teardown(name)
        left = owned_namespaces(name, namespaces())
        assert not left, f"namespaces left behind: {left}"
        assert root_links() == before, "the root namespace's devices changed"


def start(argv: list[str], children: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.append(child)
    return child


def ready_port(receiver: subprocess.Popen[str]) -> int:
    assert receiver.stdout is not None
    line = receiver.stdout.readline()  # blocks until the receiver listens (or dies)
    assert line, f"receiver died: {receiver.communicate()[1]}"
    event = json.loads(line)
    assert event["event"] == "ready"
    return int(event["port"])


def finish(child: subprocess.Popen[str], timeout: float = 60) -> dict[str, object]:
    out, err = child.communicate(timeout=timeout)
    assert child.returncode == 0, f"{child.args!r} failed:\n{err}"
    return json.loads(out.strip().splitlines()[-1]) if out.strip() else {}


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()  # reaps and closes the pipes


def _shaped_1gbit(prefix: str, children: list[subprocess.Popen[str]]) -> tuple[float, float]:
    """``lynx link up`` at 1 Gbit/s, checked; then 3 s of bulk TCP from tx to rx and ``lynx link
    measure``: (the bulk transfer's Gbit/s, measure's ratio to the rate)."""
    up = lynx("link", "up", "--rate", "1gbit", "--prefix", prefix, "--json")
    assert up.returncode == 0, up.stderr
    status = json.loads(up.stdout)
    assert status["up"] is True
    tx, rx = status["sides"]
    assert (tx["namespace"], rx["namespace"]) == (f"{prefix}-tx", f"{prefix}-rx")
    assert tx["addresses"] == ["10.254.0.1/30"] and rx["addresses"] == ["10.254.0.2/30"]
    assert tx["rate_gbps"] == 1.0 and rx["rate_gbps"] == 1.0  # both directions shaped
    assert status["ucx_env"]["rx"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": f"{prefix}-rx"}
    assert f"{prefix}-tx" not in root_links()  # nothing in the root namespace

    # 3 s of bulk TCP at 1 Gbit/s from the tx namespace to the rx namespace
    n_bytes = 375_000_000
    receiver = start(["ip", "netns", "exec", f"{prefix}-rx", *BULK, "recv",
                      "--bind", "10.254.0.2"], children)
    port = ready_port(receiver)
    sender = start(["ip", "netns", "exec", f"{prefix}-tx", *BULK, "send", "--to", "10.254.0.2",
                    "--port", str(port), "--bytes", str(n_bytes)], children)
    finish(sender)
    result = finish(receiver)
    assert result["bytes"] == n_bytes
    measured = lynx("link", "measure", "--seconds", "1", "--realtime", "--prefix", prefix,
                    "--json")
    assert measured.returncode == 0, measured.stderr
    return float(result["gbps"]), float(json.loads(measured.stdout)["ratio"])  # type: ignore[arg-type]


def test_link_up_shapes_to_1gbit_and_down_removes_everything(
        prefix: str, children: list[subprocess.Popen[str]]) -> None:
    gbps, ratio = _shaped_1gbit(prefix, children)
    # htb holds the rate: nothing beats it (a busy machine only makes the transfers slower)
    assert gbps <= 1.1, f"achieved {gbps:.3f} Gbit/s over a 1 Gbit/s link"
    assert ratio <= 1.1, ratio

    show = lynx("link", "show", "--prefix", prefix, "--json")
    assert show.returncode == 0, show.stderr
    assert {q["kind"] for q in json.loads(show.stdout)["sides"][0]["qdiscs"]} == {"htb"}

    down = lynx("link", "down", "--prefix", prefix, "--json")
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["removed"] == [f"{prefix}-tx", f"{prefix}-rx"]
    assert not {f"{prefix}-tx", f"{prefix}-rx"} & namespaces()
    assert not {f"{prefix}-tx", f"{prefix}-rx"} & root_links()
    again = lynx("link", "down", "--prefix", prefix, "--json")  # idempotent
    assert again.returncode == 0 and json.loads(again.stdout)["removed"] == []
    gone = lynx("link", "show", "--prefix", prefix, "--json")
    assert [s["present"] for s in json.loads(gone.stdout)["sides"]] == [False, False]


@pytest.mark.timing
def test_link_up_shapes_to_1gbit_within_10_percent(
        prefix: str, children: list[subprocess.Popen[str]], timing) -> None:
    gbps, ratio = _shaped_1gbit(prefix, children)
    timing.within("bulk TCP over a 1 Gbit/s link", gbps, 0.9, 1.1, "Gbit/s")
    timing.within("lynx link measure: achieved / configured rate", ratio, 0.9, 1.1)


def _kernel_takes_netem() -> bool:
    """Independent of lynx: try a netem qdisc in a namespace of the test's own."""
    ns = f"ltprobe{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        proc = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "5ms"], capture_output=True, text=True, check=False)
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=True)


def test_delay_is_emulated_only_where_the_kernel_has_netem(prefix: str) -> None:
    has_netem = _kernel_takes_netem()
    assert netem_available() is has_netem
    up = lynx("link", "up", "--rate", "1gbit", "--delay", "5ms", "--loss", "0.1%",
              "--prefix", prefix, "--json")
    if not has_netem:
        assert up.returncode == 2
        assert "no netem" in up.stderr and "delay, jitter and loss" in up.stderr
        assert not {f"{prefix}-tx", f"{prefix}-rx"} & namespaces()  # nothing was set up
        return
    assert up.returncode == 0, up.stderr
    kinds = {q["kind"] for s in json.loads(up.stdout)["sides"] for q in s["qdiscs"]}
    assert kinds == {"htb", "netem"}
    ping = subprocess.run(["ip", "netns", "exec", f"{prefix}-tx", "ping", "-c", "3", "-i", "0.2",
                           "10.254.0.2"], capture_output=True, text=True, check=False)
    assert ping.returncode == 0, ping.stderr
    assert "time=1" in ping.stdout  # ~10 ms round trip: 5 ms each way


def _two_lanes(prefix: str, children: list[subprocess.Popen[str]]) -> tuple[dict, dict]:
    """150 MB on each of two lanes of a 1 Gbit/s link, lane 1 started first; each receiver's
    result (bytes, seconds from its first byte, first: when that came, gbps)."""
    up = lynx("link", "up", "--rate", "1gbit", "--lanes", "2", "--prefix", prefix, "--json")
    assert up.returncode == 0, up.stderr
    lanes = json.loads(up.stdout)["lane_port_ranges"]
    ports = [int(lanes[str(i)].split("-")[0]) for i in range(2)]
    n_bytes = 150_000_000  # 1.2 s alone at the shaped rate
    receivers = [start(["ip", "netns", "exec", f"{prefix}-rx", *BULK, "recv", "--bind",
                        "10.254.0.2", "--port", str(port)], children) for port in ports]
    for r in receivers:
        ready_port(r)
    # lane 1 starts first: priority, not a head start, must decide
    senders = [start(["ip", "netns", "exec", f"{prefix}-tx", *BULK, "send", "--to", "10.254.0.2",
                      "--port", str(port), "--bytes", str(n_bytes)], children)
               for port in reversed(ports)]
    for s in senders:
        finish(s)
    lane0, lane1 = (finish(r) for r in receivers)
    assert lane0["bytes"] == lane1["bytes"] == n_bytes
    return lane0, lane1


def _end(lane: dict) -> float:
    return float(lane["first"]) + float(lane["seconds"])  # CLOCK_MONOTONIC, any process


def test_no_ephemeral_port_falls_in_a_lane(prefix: str) -> None:
    """The lane filters match source or destination port, so a port the kernel picks
    for some other socket (the ephemeral range 32768-60999 holds the lane ranges) would
    put that socket's bytes in a lane's class: a lane-1 sender whose source port fell in
    lane 0's range got lane 0's priority, and the two lanes shared the link. The
    namespaces reserve the lane ports; here the ephemeral range is narrowed to the lanes
    plus nine ports, and the kernel must pick only those nine."""
    up = lynx("link", "up", "--rate", "1gbit", "--lanes", "2", "--prefix", prefix, "--json")
    assert up.returncode == 0, up.stderr
    lanes = json.loads(up.stdout)["lane_port_ranges"]
    low, high = int(lanes["0"].split("-")[0]), int(lanes["1"].split("-")[1])
    ns = f"{prefix}-tx"
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                    f"net.ipv4.ip_local_port_range={low} {high + 9}"], check=True)
    program = ("import socket\n"
               "socks = [socket.socket() for _ in range(9)]\n"
               "for s in socks: s.bind(('', 0))\n"
               "print(' '.join(str(s.getsockname()[1]) for s in socks))\n")
    picked = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", program],
                            capture_output=True, text=True, check=True).stdout.split()
    assert sorted(int(p) for p in picked) == list(range(high + 1, high + 10)), (low, high, picked)


def test_lane_zero_takes_the_link_before_lane_one(
        prefix: str, children: list[subprocess.Popen[str]]) -> None:
    lane0, lane1 = _two_lanes(prefix, children)
    # fair sharing would end lane 1 (started first, as much to send) no later than lane 0;
    # priority ends lane 0 first
    assert _end(lane0) < _end(lane1), (lane0, lane1)


@pytest.mark.timing
def test_lane_zero_runs_at_nearly_the_full_rate_while_lane_one_waits(
        prefix: str, children: list[subprocess.Popen[str]], timing) -> None:
    lane0, lane1 = _two_lanes(prefix, children)
    s0, s1 = float(lane0["seconds"]), float(lane1["seconds"])
    # fair sharing would give both ~0.47 Gbit/s and equal times; priority lets lane 0
    # run at nearly the full rate while lane 1 waits for it
    timing.at_least("lane 0 over a 1 Gbit/s link with lane 1 busy", float(lane0["gbps"]), 0.8, "Gbit/s")
    timing.at_least("lane 1's time over lane 0's", s1 / s0, 1.7, "")


@pytest.mark.parametrize(("hosts", "inside"), [(1, "rx"), (3, "rx1")])
def test_ctrl_c_tears_the_link_down(prefix: str, hosts: int, inside: str) -> None:
    """A program holding ``with Link(...)`` that gets SIGINT leaves nothing behind,
    including the process it started inside the link.

    The program sets SIGINT's handler itself: a process started from a background job
    (``make test &``) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt (``restore_signals`` does not restore SIGINT)."""
    program = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from lynx_bench.netem.link import Link\n"
        "from lynx_bench.netem.config import LinkConfig\n"
        f"with Link(LinkConfig(rate_gbps=0.5, prefix={prefix!r}, hosts={hosts})) as link:\n"
        f"    inside = link.popen_in({inside!r}, ['sh', '-c', 'echo in; exec sleep 300'],\n"
        "                           stdout=subprocess.PIPE, text=True)\n"
        "    assert inside.stdout.readline() == 'in\\n'\n"
        "    print('up', flush=True)\n"
        "    sys.stdin.read()\n"  # blocks until interrupted
    )
    with subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "up\n", child.communicate()[1]
            assert len(owned_namespaces(prefix, namespaces())) == (2 if hosts == 1 else hosts + 2)
            sleeper = subprocess.run(["ip", "netns", "pids", f"{prefix}-{inside}"],
                                     capture_output=True, text=True, check=True).stdout.split()
            assert len(sleeper) == 1
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
    assert "KeyboardInterrupt" in err
    assert not owned_namespaces(prefix, namespaces())
    assert not Path(f"/proc/{sleeper[0]}").exists()


def test_down_ends_processes_left_inside(prefix: str,
                                         children: list[subprocess.Popen[str]]) -> None:
    assert lynx("link", "up", "--rate", "100mbit", "--prefix", prefix).returncode == 0
    stray = start(["ip", "netns", "exec", f"{prefix}-tx", "sh", "-c", "echo in; exec sleep 300"],
                  children)
    assert stray.stdout is not None and stray.stdout.readline() == "in\n"  # it is inside
    down = lynx("link", "down", "--prefix", prefix)
    assert down.returncode == 0, down.stderr
    assert stray.wait(timeout=10) != 0  # ended by a signal
    assert not {f"{prefix}-tx", f"{prefix}-rx"} & namespaces()


def test_up_refuses_to_touch_a_namespace_it_did_not_create(prefix: str) -> None:
    foreign = f"{prefix}-rx"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    up = lynx("link", "up", "--rate", "1gbit", "--prefix", prefix)
    assert up.returncode == 2
    assert "already exist" in up.stderr and f"lynx link down --prefix {prefix}" in up.stderr
    assert foreign in namespaces()  # left alone
    assert f"{prefix}-tx" not in namespaces()  # and nothing half-made


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# What `lynx link` imports beyond the standard library (the lynx packages, numpy, ...), as this
# test's own interpreter finds them: each top-level module's name and file. (`lynx link --help`
# builds the whole command line, which imports every subcommand's module, as every run does.)
_IMPORTS = """\
import contextlib, io, json, sys
before = set(sys.modules)
import lynx_bench.cli, lynx_bench.netem.cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    lynx_bench.cli.main(["link", "--help"])
paths = {}
for name in sorted({name.split(".")[0] for name in set(sys.modules) - before} - sys.stdlib_module_names):
    path = getattr(sys.modules.get(name), "__file__", None)
    if path:
        paths[name] = path
print(json.dumps(paths))
"""


def _lynx_for_nobody(root: Path) -> list[str]:
    """A ``lynx`` command user nobody can run, whatever folder this checkout and its virtual
    environment are in (a clone under a 0700 ``mktemp -d`` folder, say): the packages that
    `lynx link` imports copied into ``root`` (hard links where the filesystem allows), run by
    an interpreter of this Python version that nobody can execute."""
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, check=True)
    for name, path in json.loads(out.stdout).items():
        src = Path(path)
        if src.name == "__init__.py":  # a package: the folder, and a wheel's `<name>.libs` beside it
            for folder in (src.parent, src.parent.with_name(f"{src.parent.name}.libs")):
                if folder.is_dir():
                    shutil.copytree(folder, root / (name if folder == src.parent else folder.name),
                                    ignore=shutil.ignore_patterns("__pycache__"), copy_function=_link_or_copy)
        else:
            _link_or_copy(str(src), str(root / src.name))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # the base interpreter first: its sys.path has nothing of this checkout, only the copy
    candidates = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), sys.executable,
                  shutil.which(f"python{version}") or "", shutil.which("python3") or ""]
    for python in dict.fromkeys(c for c in candidates if c):
        probe = subprocess.run([*NOBODY, python, "-s", "-c", "import sys; print(sys.version_info[:2])"],
                               capture_output=True, text=True, cwd=root, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
            code = (f"import runpy, sys; sys.path.insert(0, {str(root)!r}); "
                    "runpy.run_module('lynx_bench.cli', run_name='__main__', alter_sys=True)")
            return [*NOBODY, python, "-s", "-c", code]
    pytest.fail(f"user nobody can run none of the Python {version} interpreters {candidates}")


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)
    return dst


@pytest.fixture
def nobody_root() -> Iterator[Path]:
    """A fresh folder anyone can read (``/tmp``, not the checkout's or pytest's 0700 ones)."""
    root = Path(tempfile.mkdtemp(prefix="lynx-nobody-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root)


def test_without_root_the_error_points_to_the_shaper(prefix: str, nobody_root: Path) -> None:
    """As an unprivileged user (root drops to nobody with setpriv): a clear refusal."""
    as_nobody = _lynx_for_nobody(nobody_root)
    for action in (["up", "--rate", "1gbit"], ["show"]):
        proc = subprocess.run([*as_nobody, "link", *action, "--prefix", prefix], cwd=nobody_root,
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2, proc.stderr
        assert "not running as root" in proc.stderr and "--link shaper" in proc.stderr
    assert not {f"{prefix}-tx", f"{prefix}-rx"} & namespaces()


# -- several decode hosts on a bridge ------------------------------------------------


def test_three_hosts_come_up_on_a_bridge_and_go_down_leaving_nothing(prefix: str) -> None:
    up = lynx("link", "up", "--rate", "1gbit", "--hosts", "3", "--prefix", prefix, "--json")
    assert up.returncode == 0, up.stderr
    status = json.loads(up.stdout)
    assert status["up"] is True and status["hosts"] == 3
    names = ["tx", "rx0", "rx1", "rx2"]
    assert [s["host"] for s in status["sides"]] == names
    assert [s["namespace"] for s in status["sides"]] == [f"{prefix}-{n}" for n in names]
    assert [s["addresses"] for s in status["sides"]] == [
        [f"10.254.0.{i}/27"] for i in range(1, 5)]
    assert all(s["rate_gbps"] == 1.0 for s in status["sides"])  # every host's egress
    assert status["switch"]["namespace"] == f"{prefix}-sw"
    assert status["switch"]["ports"] == names and status["switch"]["state"] == "UP"
    assert status["ucx_env"]["rx2"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": f"{prefix}-rx2"}
    assert owned_namespaces(prefix, namespaces()) == [
        *(f"{prefix}-{n}" for n in names), f"{prefix}-sw"]

    shown = lynx("link", "status", "--prefix", prefix)
    assert shown.returncode == 0, shown.stderr
    assert "3 decode hosts" in shown.stdout and "bridge br (UP)" in shown.stdout
    for i, n in enumerate(names):
        assert f"  {n}: netns {prefix}-{n}  dev {prefix}-{n} (UP)  10.254.0.{i + 1}/27" \
            in shown.stdout, shown.stdout

    down = lynx("link", "down", "--prefix", prefix, "--json")
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["removed"] == [*(f"{prefix}-{n}" for n in names),
                                                  f"{prefix}-sw"]
    assert not owned_namespaces(prefix, namespaces())  # and the fixture checks the root's devices
    again = lynx("link", "down", "--prefix", prefix, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["removed"] == []


def _transfer(link: Link, src: str, dst: str, n_bytes: int = 1_000_000) -> int:
    """Send ``n_bytes`` from host ``src`` to host ``dst`` with the bulk tool; bytes received."""
    bulk = [sys.executable, "-m", "lynx_bench.netem.bulk"]
    receiver = link.popen_in(dst, [*bulk, "recv", "--bind", link.address(dst), "--timeout", "10"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = ready_port(receiver)
        sent = link.run_in(src, [*bulk, "send", "--to", link.address(dst), "--port", str(port),
                                 "--bytes", str(n_bytes), "--timeout", "10"],
                           capture_output=True, text=True, timeout=20)
        assert sent.returncode == 0, f"{src} -> {dst}: {sent.stderr}"
        return int(finish(receiver, timeout=20)["bytes"])  # type: ignore[call-overload]
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.communicate()


def test_each_decode_host_and_the_prefill_host_reach_each_other(prefix: str) -> None:
    with Link(LinkConfig(rate_gbps=1.0, hosts=3, prefix=prefix)) as link:
        # the prefill host has one device besides lo, so everything it sends meets its htb
        out = subprocess.run(["ip", "-n", link.namespace("tx"), "-j", "link", "show"],
                             capture_output=True, text=True, check=True).stdout
        assert sorted(d["ifname"] for d in json.loads(out)) == sorted(["lo", f"{prefix}-tx"])
        assert link.ucx_env(link.prefill_host)["UCX_NET_DEVICES"] == f"{prefix}-tx"
        for i, host in enumerate(link.decode_hosts):
            name = f"rx{i}"
            assert link.address("rx", i) == link.address(host) == f"10.254.0.{i + 2}"
            assert link.exec_argv(host, ["true"]) == ["ip", "netns", "exec", f"{prefix}-{name}",
                                                      "true"]
            assert link.ucx_env(host) == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": f"{prefix}-{name}"}
            assert _transfer(link, "tx", name) == 1_000_000
            assert _transfer(link, name, "tx") == 1_000_000


def _two_hosts_at_once(prefix: str) -> dict:
    """Three decode hosts behind a 1 Gbit/s prefill host; ``lynx link measure`` to two of them
    at once (2 s together at the rate; rx1 idles)."""
    up = lynx("link", "up", "--rate", "1gbit", "--hosts", "3", "--prefix", prefix)
    assert up.returncode == 0, up.stderr
    measured = lynx("link", "measure", "--seconds", "2", "--realtime", "--to", "rx0,rx2",
                    "--prefix", prefix, "--json")
    assert measured.returncode == 0, measured.stderr
    result = json.loads(measured.stdout)
    hosts = result["hosts"]
    assert [h["host"] for h in hosts] == ["rx0", "rx2"]
    assert all(h["bytes"] == 125_000_000 for h in hosts)
    return result


def test_htb_holds_two_decode_hosts_together_to_the_rate(prefix: str) -> None:
    result = _two_hosts_at_once(prefix)
    # served at once: the two transfers overlap (one after the other, their times would add up
    # to at most the whole span)
    assert sum(h["seconds"] for h in result["hosts"]) > result["seconds"], result
    # the sum is the rate, not twice it (a busy machine only makes the transfers slower): htb's
    # own count of frames within 5%, the TCP payload below the rate (the headers)
    assert result["htb_ratio"] <= 1.05, result
    assert result["ratio"] <= 1.0, result


@pytest.mark.timing
def test_htb_shares_the_rate_between_two_decode_hosts(prefix: str, timing) -> None:
    result = _two_hosts_at_once(prefix)
    for h in result["hosts"]:
        # both were served at once (each ~R/2 over nearly the whole span), not one after the other
        timing.at_least(f"{h['host']}'s span over the whole transfer's", h["seconds"] / result["seconds"], 0.8, "")
        timing.within(f"{h['host']}'s share of the 1 Gbit/s link", h["gbps"], 0.35, 0.65, "Gbit/s")
    # htb's own count of frames within 5% of the rate, and the TCP payload below it by about
    # the headers (1448 of each 1514 bytes)
    timing.within("htb's frames over the span / the rate", result["htb_ratio"], 0.95, 1.05)
    timing.within("TCP payload over the span / the rate", result["ratio"], 0.90, 1.0)


@pytest.mark.parametrize("argv", [["--hosts", "0"], ["--hosts", "17"], ["--hosts", "-2"],
                                  ["--hosts", "3", "--subnet", "10.254.0.0/30"]])
def test_bad_hosts_are_refused_before_anything_is_created(prefix: str, argv: list[str]) -> None:
    before = namespaces()
    up = lynx("link", "up", "--rate", "1gbit", *argv, "--prefix", prefix)
    assert up.returncode == 2, up.stderr
    assert up.stderr.startswith("lynx: error: ") and ("hosts" in up.stderr), up.stderr
    assert namespaces() == before


def test_a_failure_while_setting_up_many_hosts_removes_everything(
        prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_sh = lynx_bench.netem.link.sh
    ran: list[list[str]] = []

    def failing_sh(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        ran.append(list(argv))
        if argv[0] == "tc" and f"{prefix}-rx2" in argv:  # the last host's shaping
            raise LinkError("injected failure")
        return real_sh(argv, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lynx_bench.netem.link, "sh", failing_sh)
    with pytest.raises(LinkError, match="injected failure"):
        Link(LinkConfig(rate_gbps=1.0, hosts=3, prefix=prefix)).up()
    assert any(a[:3] == ["ip", "netns", "add"] and a[3] == f"{prefix}-sw" for a in ran)
    assert not owned_namespaces(prefix, namespaces())
