"""The peer engines' pure parts: choosing them, summarising latency, picking a configuration."""

from __future__ import annotations

import pytest

from lynx_bench.transport_bench.cli import engines
from lynx_bench.transport_bench.peer_runs import NIXL, best_of, latency_summary
from lynx_bench.transport_bench.peers.engines import ENGINES, Engine, install_hint


def test_engines_from_the_flag() -> None:
    assert engines("nixl,mooncake") == [Engine.NIXL, Engine.MOONCAKE]
    assert engines("mooncake") == [Engine.MOONCAKE]
    assert engines("none") == []
    with pytest.raises(SystemExit, match="unknown --peers foo"):
        engines("nixl,foo")


def test_latency_p99_is_the_nearest_rank() -> None:
    seconds = [i * 1e-6 for i in range(1, 101)]  # 1..100 us
    assert latency_summary(seconds) == {"messages": 100, "median_us": 50.5, "p99_us": 99.0}
    assert latency_summary([5e-6, 1e-6, 3e-6])["p99_us"] == 5.0


def test_best_of_names_the_faster_configuration() -> None:
    fast, slow = list(NIXL)
    assert best_of({fast: 3.0, slow: 5.0}, NIXL) == (5.0, NIXL[slow].value)
    assert best_of({fast: 3.0}, NIXL) == (3.0, NIXL[fast].value)
    assert best_of({}, NIXL) == (None, None)


def test_nixl_never_installs_its_declared_torch() -> None:
    nixl = ENGINES[Engine.NIXL]
    assert ("--no-deps", "nixl-cu12==1.5.1") in nixl.pip
    assert not any("torch" in arg for args in nixl.pip for arg in args)
    assert "--install-peers" in install_hint(Engine.NIXL)
    assert "apt-get install -y libibverbs1" in install_hint(Engine.MOONCAKE)
