"""I/O-thread state of a sender: its connections (peers) and their outgoing streams.

Owned by the ``lynx-tx-io`` thread (:mod:`lynx_transport.ucx.sender_loop`); plain data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx_transport.errors import TransportError
from lynx_transport.protocol.shaper import Shaper
from lynx_transport.send_stream import SendStream
from lynx_transport.stats import LaneCounters
from lynx_transport.ucx.control import ControlSocket

__all__ = ["Peer", "TxStream"]


class Peer:
    """I/O-thread state of one connection: its receiver, streams, shaping and counters.

    ``broken`` is written by the I/O thread only; any thread may read it.
    """

    def __init__(self, key: int, ctl: ControlSocket, eps: list[Any], address: tuple[str, int],
                 shaper: Shaper, chunk_sums: bool, conn_key: int = 0, max_open: int = 0) -> None:
        self.key = key
        self.conn_key = conn_key        # the receiver's key for this connection (wire.stream_token)
        self.max_open = max_open        # largest OPEN_SENT payload it takes (0: none)
        self.ctl = ctl
        self.eps = eps                  # one endpoint per receive rail (wire.rail_of)
        self.address = address
        self.shaper = shaper
        self.chunk_sums = chunk_sums    # the receiver asked for CHUNK_SUMs
        self.streams: dict[int, TxStream] = {}
        self.counters = LaneCounters()
        self.completed = 0
        self.failed = 0
        self.broken: TransportError | None = None


@dataclasses.dataclass
class TxStream:
    handle: SendStream
    peer: Peer
    views: list[Any | None]
    token: int | None = None        # known at open when ``sent``, else from ACCEPT
    sent: bool = False              # opened with OPEN_SENT: chunks go before the ACCEPT
    accepted: bool = False
    inflight: int = 0
    cancelling: bool = False
    cancel_sent: bool = False
    supplied: list[int] = dataclasses.field(default_factory=list)  # in supply order
