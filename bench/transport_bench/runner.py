"""The runner interface of ``lynx bench-transport``: one runner per backend, one call per round.

A :class:`Runner` measures one backend (or one message group of it, e.g. Lynx's
64 KiB latency) for one round: :meth:`Runner.run` sends what the :class:`Plan`
says, warm-up first, and returns a :class:`Record` of what it timed.
:func:`lynx_bench.transport_bench.cli.measure` calls the round's runners in the
order :meth:`lynx_bench.transport_bench.backends.Backends.runners` gives (the
interleaving) and merges their records into one with :meth:`Record.add`. A
runner holds its backend's connection; starting and stopping the processes is
the owner's (:class:`~lynx_bench.transport_bench.backends.Backends`), not the
runner's.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

__all__ = ["LATENCY_SIZES", "Plan", "Record", "Runner"]

#: Message sizes of the latency run: an anchor region's order of size, and a chunk's.
LATENCY_SIZES = (64 * 1024, 1024 * 1024)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every round measures: ``messages`` timed messages of ``nbytes`` per throughput
    backend, ``latency_messages`` per size of :data:`LATENCY_SIZES` per latency backend,
    over ``rounds`` rounds; ``tls`` is the default UCX path's ``UCX_TLS``."""

    nbytes: int
    rounds: int
    messages: int
    latency_messages: int
    tls: str


@dataclasses.dataclass
class Record:
    """Timings, keyed by the backend names of the JSON: seconds per message
    (``throughput_s``; ``latency_s`` and Lynx's ``data_latency_s`` per message size),
    Lynx's end-to-end seconds of its default-path throughput messages
    (``end_to_end_s``) and ``ucx_perftest``'s runs (``perftest_gbps``, ``perftest_tcp_gbps``
    over ``UCX_TLS=tcp``; ``perftest_latency_us``
    per message size, each run's own 50th percentile)."""

    throughput_s: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    latency_s: dict[str, dict[int, list[float]]] = dataclasses.field(default_factory=dict)
    data_latency_s: dict[str, dict[int, list[float]]] = dataclasses.field(default_factory=dict)
    end_to_end_s: list[float] = dataclasses.field(default_factory=list)
    perftest_gbps: list[float] = dataclasses.field(default_factory=list)
    perftest_tcp_gbps: list[float] = dataclasses.field(default_factory=list)
    perftest_latency_us: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    def add(self, other: Record) -> None:
        """Append ``other``'s timings to this record's; a backend or size new to it is
        added after those it has (the JSON keeps that order)."""
        for name, seconds in other.throughput_s.items():
            self.throughput_s.setdefault(name, []).extend(seconds)
        for mine, theirs in ((self.latency_s, other.latency_s),
                             (self.data_latency_s, other.data_latency_s)):
            for name, sizes in theirs.items():
                for size, seconds in sizes.items():
                    mine.setdefault(name, {}).setdefault(size, []).extend(seconds)
        self.end_to_end_s.extend(other.end_to_end_s)
        self.perftest_gbps.extend(other.perftest_gbps)
        self.perftest_tcp_gbps.extend(other.perftest_tcp_gbps)
        for size, runs in other.perftest_latency_us.items():
            self.perftest_latency_us.setdefault(size, []).extend(runs)


class Runner(Protocol):
    """One backend's measurement of one round."""

    @property
    def phase(self) -> str:
        """The progress line's name for what it measures (``throughput``, ``latency``, or
        a peer backend's name); consecutive runners of one phase share one line."""
        ...

    def run(self, plan: Plan) -> Record:
        """Send for ``WARM_UP_S``, then time the plan's messages; blocks until they are
        done. Raises ``RuntimeError`` when a message fails; a peer engine found unable
        to run returns an empty record (and is listed as skipped by its owner)."""
        ...
