"""The peer engines' side of ``lynx bench-transport``: NIXL and Mooncake TE next to Lynx.

:class:`PeerBackends` runs every selected engine as its two processes, one
backend at a time, records the engines that cannot run as *skipped* with the
reason and install hint, and times groups of messages on request, so the
benchmark can interleave them with its own backends in rounds. Backend names
(the JSON's):

* ``nixl_progress_thread``, ``nixl_polling`` - NIXL on the default UCX path
  (``--tls``, cma between two processes), in its two documented configurations
  (:class:`lynx_bench.transport_bench.peers.nixl.NixlConfig`);
* ``nixl_tcp_progress_thread``, ``nixl_tcp_polling`` - the same over ``UCX_TLS=tcp``;
* ``mooncake_tcp`` - Mooncake TE over TCP (its ``non-cuda`` wheel's only transport).

:class:`PeerRun` is one backend's :class:`~lynx_bench.transport_bench.runner.Runner`.
:func:`best_of` picks an engine's faster configuration from the medians;
:func:`latency_summary` is the per-message latency the JSON reports.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from typing import Any

from lynx_bench.transport_bench.peers.engines import WARM_UP_S, Engine, missing
from lynx_bench.transport_bench.peers.mooncake import MooncakePair
from lynx_bench.transport_bench.peers.nixl import NixlConfig, NixlPair
from lynx_bench.transport_bench.runner import LATENCY_SIZES, Plan, Record

__all__ = ["PeerBackends", "PeerRun", "TCP_TLS", "best_of", "latency_summary", "NIXL", "NIXL_TCP",
           "MOONCAKE_TCP", "NIXL_NOTIFIED"]

#: The UCX path every ``*_tcp`` backend uses.
TCP_TLS = "tcp"
NIXL = {f"nixl_{c.value}": c for c in NixlConfig}
NIXL_TCP = {f"nixl_tcp_{c.value}": c for c in NixlConfig}
MOONCAKE_TCP = "mooncake_tcp"
#: NIXL's writes with a notification, so its target is told (:meth:`NixlPair.notified`),
#: measured with the polling configuration's processes on the default path.
NIXL_NOTIFIED = "nixl_notified"
_NOTIFIED_ON = f"nixl_{NixlConfig.POLLING.value}"


class PeerBackends:
    """Every selected peer engine's backends; each runs its groups in processes of its own.

    A backend's two processes live only for its groups of one round
    (:meth:`run`): an idle NIXL agent's progress thread takes a quarter of a core
    (measured), which would be taken from every other backend of the run. An
    engine found unable to run (not installed, or its import failing in its child)
    is listed in :attr:`skipped` with the reason and install hint."""

    def __init__(self, engines: list[Engine], nbytes: int, tls: str, ucx_env: dict[str, str]) -> None:
        """``ucx_env``: the ``UCX_*`` variables as the benchmark found them, before ucxx's
        import added its own (see :mod:`lynx_bench.transport_bench.peers.nixl`)."""
        self.nbytes = nbytes
        self.skipped: dict[str, str] = {}
        self._backends: dict[str, tuple[Engine, Callable[[], Any]]] = {}
        for engine in engines:
            reason = missing(engine)
            if reason is not None:
                self.skipped[engine.value] = reason
            elif engine is Engine.NIXL:
                for names, path in ((NIXL, tls), (NIXL_TCP, TCP_TLS)):
                    for name, config in names.items():
                        make = functools.partial(NixlPair, nbytes, path, config, ucx_env)
                        self._backends[name] = (engine, make)
            else:
                self._backends[MOONCAKE_TCP] = (engine, functools.partial(MooncakePair, nbytes))

    def names(self) -> list[str]:
        return list(self._backends)

    def run(self, name: str, groups: list[tuple[int, int, bool, bool]], warm_up_s: float
            ) -> list[list[float]] | None:
        """Start ``name``'s processes, time each group ``(size, messages, written, notified)``
        (seconds per message, after ``warm_up_s`` of the same writes; from a written
        buffer or the never-written one; ``notified``: NIXL's writes with a notification,
        until the target sees it), stop them. None (and the engine skipped from now on)
        when the engine cannot run here."""
        if name not in self._backends:  # its engine was found unable to run meanwhile
            return None
        engine, make = self._backends[name]
        pair = make()
        try:
            reason = pair.connect()
            if reason is not None:
                self.skipped[engine.value] = reason
                for other in [n for n, (e, _) in self._backends.items() if e is engine]:
                    del self._backends[other]
                return None
            return [pair.notified(size, messages, warm_up_s) if notified
                    else pair.timed(size, messages, warm_up_s, written)
                    for size, messages, written, notified in groups]
        finally:
            pair.close()


@dataclasses.dataclass(frozen=True)
class PeerRun:
    """Backend ``name`` of ``peers`` for one round: ``plan.messages`` of ``plan.nbytes`` from
    the never-written buffer, from a written one too for NIXL on the default path (where the
    zero page's effect is large; over tcp the kernel's socket copies dominate), then
    ``plan.latency_messages`` per size of :data:`LATENCY_SIZES`, all in one start of its
    processes; for ``nixl_polling``, :data:`NIXL_NOTIFIED`'s latency groups too. An empty
    record when its engine cannot run."""

    name: str
    peers: PeerBackends

    @property
    def phase(self) -> str:
        return self.name

    def run(self, plan: Plan) -> Record:
        written = [(plan.nbytes, plan.messages, True, False)] if self.name in NIXL else []
        latency = [(size, plan.latency_messages, False, False) for size in LATENCY_SIZES]
        notified = ([(size, plan.latency_messages, False, True) for size in LATENCY_SIZES]
                    if self.name == _NOTIFIED_ON else [])
        groups = [(plan.nbytes, plan.messages, False, False), *written, *latency, *notified]
        got = self.peers.run(self.name, groups, WARM_UP_S)
        if got is None:
            return Record()
        record = Record(throughput_s={self.name: got[0]})
        if written:
            record.throughput_s[self.name + "_written"] = got[1]
        first = 1 + len(written)
        record.latency_s[self.name] = dict(zip(LATENCY_SIZES, got[first:first + len(latency)], strict=True))
        if notified:
            record.latency_s[NIXL_NOTIFIED] = dict(zip(LATENCY_SIZES, got[first + len(latency):], strict=True))
        return record


def best_of(gbps: dict[str, float], names: dict[str, NixlConfig]) -> tuple[float | None, str | None]:
    """The faster of an engine's configurations ``names`` (backend -> configuration):
    ``(gbps, configuration)``, or ``(None, None)`` when none ran."""
    ran = {names[n].value: gbps[n] for n in names if n in gbps}
    if not ran:
        return None, None
    config = max(ran, key=lambda c: ran[c])
    return ran[config], config


def latency_summary(seconds: list[float]) -> dict[str, Any]:
    """Median and P99 per message (microseconds; P99 by the nearest-rank rule) of ``seconds``."""
    ordered = sorted(seconds)
    rank = max(1, -(-99 * len(ordered) // 100))  # ceil(0.99 n)
    return {"messages": len(ordered), "median_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[rank - 1] * 1e6, 1)}
