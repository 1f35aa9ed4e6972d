"""Per-request timestamps of the proxy: what a benchmark needs to split a request's latency into
the prefill leg, the hand-off and the decode leg (wall clock, ``time.time()``, as the consumer's
``stats_path`` records, so the two line up on one host or on hosts with synchronised clocks).

:class:`StatsLog` keeps the last requests in memory (``GET /lynx/requests``) and appends each to a
JSON-lines file when given one. Not thread-safe: the proxy calls it from its one event loop.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

__all__ = ["RequestTimes", "StatsLog"]


@dataclasses.dataclass
class RequestTimes:
    """One request through the proxy. Times are wall-clock seconds (None: the step was not reached).

    ``arrived_at``: the client's request read; ``prefill_sent_at`` / ``prefill_answered_at``: the
    prefill leg's request sent / its whole answer read; ``decode_sent_at``: the decode leg's request
    sent; ``decode_first_byte_at``: the first bytes of the decode leg's body; ``done_at``: the last
    byte relayed to the client (or the failure). ``prompt_tokens`` and ``remote_prefill`` come from
    the prefill answer's ``kv_transfer_params`` (``remote_prefill``: the decode leg was told where
    the cache is); ``error`` / ``failed_leg`` say what went wrong, if anything.
    """

    request_id: str
    endpoint: str
    stream: bool
    arrived_at: float
    prefill_sent_at: float | None = None
    prefill_answered_at: float | None = None
    prefill_status: int | None = None
    decode_sent_at: float | None = None
    decode_first_byte_at: float | None = None
    decode_status: int | None = None
    done_at: float | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    remote_prefill: bool = False
    scheme: str | None = None
    planes: list[int] | None = None
    error: str | None = None
    failed_leg: str | None = None

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """The one log line of the request."""
        def since(at: float | None) -> str:
            return "-" if at is None else f"{at - self.arrived_at:.3f}s"

        line = (f"{self.request_id} {self.endpoint}{' stream' if self.stream else ''}: "
                f"prefill {self.prefill_status or '-'} at {since(self.prefill_answered_at)}, "
                f"decode {self.decode_status or '-'} first byte {since(self.decode_first_byte_at)}, "
                f"done {self.status or '-'} at {since(self.done_at)}")
        if self.prompt_tokens is not None:
            line += f", {self.prompt_tokens} prompt tokens"
        if not self.remote_prefill and self.prefill_status == 200:
            line += ", no kv_transfer_params from the prefill (the decode server computed the prompt)"
        if self.error is not None:
            line += f": {self.error}"
        return line


class StatsLog:
    """The last ``ring`` requests' records, and every one appended to ``path`` (JSON lines) if given."""

    def __init__(self, ring: int = 1024, path: str | None = None) -> None:
        self._ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=ring)
        self.path = path

    def add(self, times: RequestTimes) -> None:
        record = times.record()
        self._ring.append(record)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        """The kept records, oldest first."""
        return list(self._ring)
