"""The targets of ``lynx bench-transport`` (``--check``) and which a result met.

:data:`TARGETS` maps a result field to ``(">=" or "<=", bound)``; :func:`targets_met`
says per target whether a result's field meets it (null where the field is null:
its peer engine was skipped). Imports nothing heavy, so the ``lynx`` parser can load it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TARGETS", "targets_met"]

#: The targets: lynx >= 0.9x ucx_perftest and >= 1.0x asyncio TCP for 64 MiB
#: messages, anchor_under_load_ratio <= 1.1, shaping_error <= 0.05 on both
#: transports; against the peer engines (issue 18) >= 1.0x NIXL (its faster
#: configuration) on both paths and Mooncake TE over TCP, and a 64 KiB P99 no
#: worse than the best peer's on the same path; one-way per stream (issue 24): a 64 KiB
#: stream's median <= 60 us and P99 <= 250 us, <= 3x ucx_perftest's tag latency, over tcp
#: no slower than Mooncake's write, and a 1 MiB stream <= 2x NIXL's (polling) write.
#: A target whose peer was skipped
#: is null in ``targets_met``, never counted as met.
TARGETS = {
    "lynx_vs_ucx_perftest": (">=", 0.9),
    "lynx_vs_asyncio_tcp": (">=", 1.0),
    "anchor_under_load_ratio": ("<=", 1.1),
    "shaping_error": ("<=", 0.05),
    "shaping_error_tcp": ("<=", 0.05),
    "lynx_vs_nixl": (">=", 1.0),
    "lynx_tcp_vs_nixl_tcp": (">=", 1.0),
    "lynx_tcp_vs_mooncake_tcp": (">=", 1.0),
    "lynx_p99_64k_vs_best_peer": ("<=", 1.0),
    "lynx_tcp_p99_64k_vs_best_peer": ("<=", 1.0),
    "lynx_oneway_64k_median_us": ("<=", 60.0),
    "lynx_oneway_64k_p99_us": ("<=", 250.0),
    "lynx_oneway_64k_vs_ucx_perftest": ("<=", 3.0),
    "lynx_tcp_oneway_64k_vs_mooncake_tcp": ("<=", 1.0),
    "lynx_oneway_1m_vs_nixl_polling": ("<=", 2.0),
}


def targets_met(result: dict[str, Any]) -> dict[str, bool | None]:
    """Per target, whether ``result`` meets it; None where its field is None."""
    return {k: None if result[k] is None else (result[k] >= v if op == ">=" else result[k] <= v)
            for k, (op, v) in TARGETS.items()}
