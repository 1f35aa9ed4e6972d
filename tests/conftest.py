"""Shared test configuration.

GPU tests are skipped by a capability probe at collection time (never by catching
failures); the probe's reason is shown in the summary (`-ra`). netns tests need
root and iproute2; they are skipped with the reason when either is missing.

Wall-clock checks live in tests marked ``timing`` and go through the ``timing``
fixture (:mod:`tests.timing`); the summary lists every measurement with its bound.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

import pytest

from lynx_bench.cli import PROCESS_ENV
from tests.timing import RECORDS, Timing


def pytest_configure(config: pytest.Config) -> None:
    # As the `lynx` CLI does before torch loads (see lynx_bench.cli.PROCESS_ENV): the tests
    # check bit-equal logits across torch thread counts, which MKL guarantees only with
    # MKL_CBWR, and run model steps beside busy processes, where spinning OpenMP threads stall.
    for name, value in PROCESS_ENV:
        os.environ.setdefault(name, value)
    config.stash[RECORDS] = []


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when CuPy and a CUDA device are usable, else why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'lynx-kv[gpu]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device"


@functools.cache
def netns_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords and (reason := gpu_unavailable_reason()):
            item.add_marker(pytest.mark.skip(reason=f"gpu: {reason}"))
        if "netns" in item.keywords and (reason := netns_unavailable_reason()):
            item.add_marker(pytest.mark.skip(reason=f"netns: {reason}"))


class BusyPollUCX:
    """UCX in latency mode: every config it is handed (or the default) gets
    ``busy_poll=True``, so a test body written for the seam runs over polling I/O threads."""

    def __repr__(self) -> str:
        return "UCX(busy_poll)"

    @staticmethod
    def _polling(config):
        from lynx_transport import TransportConfig

        return dataclasses.replace(config or TransportConfig(), busy_poll=True)

    def connect(self, address, *, timeout, config=None):
        from lynx_transport import UCX

        return UCX.connect(address, timeout=timeout, config=self._polling(config))

    def egress(self, config=None):
        from lynx_transport import UCX

        return UCX.egress(self._polling(config))

    def listen(self, pool, *, host="127.0.0.1", port=0, config=None, callbacks=None):
        from lynx_transport import UCX

        return UCX.listen(pool, host=host, port=port, config=self._polling(config), callbacks=callbacks)


@pytest.fixture(params=["memory", pytest.param("ucx", marks=pytest.mark.ucx),
                        pytest.param("ucx-busy-poll", marks=pytest.mark.ucx)])
def transport(request: pytest.FixtureRequest):
    """Each transport behind ``lynx_transport.seam.Transport``: the in-memory twin
    (a fresh network per test), the real one (UCX, marked ``ucx``) and the real one in
    latency mode (``TransportConfig.busy_poll``). A test that takes it runs once per
    transport: one test body, every implementation."""
    if request.param == "memory":
        from lynx_transport.testing import MemoryTransport

        return MemoryTransport()
    if request.param == "ucx-busy-poll":
        return BusyPollUCX()
    from lynx_transport import UCX

    return UCX


@pytest.fixture
def timing(request: pytest.FixtureRequest) -> Timing:
    """Wall-clock checks for a test marked ``timing`` (only there: everywhere else a
    test asserts causes, not durations). Each check is listed in the summary."""
    if request.node.get_closest_marker("timing") is None:
        pytest.fail(f"{request.node.nodeid} checks wall-clock bounds: mark it @pytest.mark.timing "
                    "(see tests/timing.py)", pytrace=False)
    return Timing(request.node.nodeid, request.config.stash[RECORDS])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    records = config.stash.get(RECORDS, [])
    if records:
        terminalreporter.section("timing: measured values and their bounds")
        for record in records:
            terminalreporter.line(record.line())
