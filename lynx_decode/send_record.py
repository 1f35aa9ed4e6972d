"""What the prefill node did for one request: its :class:`SendRecord`, and a
JSON-lines file of them (``lynx serve --records FILE``, read by the sweep and
the load generator, which join each record to its decode node's run by
``request_id``).

Clocks (seconds from the request's ``t0``, the moment its cache was held ready
to send, the same ``t0`` its KV header carries):

* ``first_supplied_s``: the first anchor region handed to the transport;
* ``first_byte_s``: the stream's first chunk handed to UCX (the memory twin:
  to its link), i.e. the first byte on the wire. It follows the stream's
  opening, so it counts any round trip the transport makes before sending;
* ``sent_s``: the receiver's confirmation of the whole stream.

``queued_s`` is the time before ``t0``: the node's queue, the prefill and the
encoding. ``held_bytes`` is what the node holds for this prompt once it is sent
(every encoded form, and the float32 cache when it keeps it).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SendRecord", "RecordsFile", "read_records", "wait_record"]


@dataclasses.dataclass(frozen=True)
class SendRecord:
    """One request the prefill node sent (see the module docstring for the clocks)."""

    request_id: str
    scheme: str
    planes: tuple[int, ...] | None
    t0_unix: float
    queued_s: float
    first_supplied_s: float
    first_byte_s: float | None
    sent_s: float
    bytes_anchor: int
    bytes_residual: int
    held_bytes: int

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["planes"] = None if self.planes is None else list(self.planes)
        return out


class RecordsFile:
    """Appends each record as one JSON line to ``path`` (flushed at once, so a
    reader sees a request's record as soon as its send finished). Thread-safe:
    the prefill node's send threads share one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def __call__(self, record: SendRecord) -> None:
        line = json.dumps(record.to_json()) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(path: str | Path) -> dict[str, dict[str, Any]]:
    """The records in ``path`` by ``request_id`` (a missing file: none; a line
    still being written is skipped)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("request_id"), str):
            out[record["request_id"]] = record
    return out


def wait_record(path: str | Path, request_id: str, timeout: float, *,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> dict[str, Any] | None:
    """The record of ``request_id`` in ``path``, waiting up to ``timeout`` seconds
    for it (the node writes it once the receiver confirmed the stream, which may
    come just after the decode node's run ended); None if it never came."""
    deadline = clock() + timeout
    while True:
        record = read_records(path).get(request_id)
        if record is not None or clock() >= deadline:
            return record
        sleep(0.02)
