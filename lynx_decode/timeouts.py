"""Every timeout of a node, in one frozen object carried from the CLI to the transport."""

from __future__ import annotations

import dataclasses
import math

from lynx_transport.config import TransportConfig
from lynx_transport.errors import ConfigError

__all__ = ["Timeouts"]


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """How long a node waits, in seconds (the CLI's ``--*-timeout`` flags).

    connect_s:
        A sender's ``connect``: the TCP connect, and again the handshake
        (``Transport.connect(timeout=)``). A node that asks a peer that is not
        there fails after at most about twice this.
    handshake_s:
        A receiver drops a connection that has not finished its handshake in
        this time (``TransportConfig.handshake_timeout_s``).
    peer_s:
        Silence after which a peer counts as lost and its streams fail
        (``TransportConfig.peer_timeout_s``, whose default it shares; heartbeats
        go out at a third of it at most). A crashed peer's closed socket is
        noticed at once, whatever this is.
    stream_s:
        One request end to end: the decode node waits this long for the stream
        to open, each region and the confirmation; the prefill node for a
        request's prompt and for the decode node's confirmation of a cache.
    residual_s:
        Once drafting started, the decode node waits at most this long for the
        residual (``None``: ``stream_s``); then ``MissingFull`` decides.
    """

    connect_s: float = 10.0
    handshake_s: float = 5.0
    peer_s: float = TransportConfig.peer_timeout_s
    stream_s: float = 120.0
    residual_s: float | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "residual_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"timeout {field.name} must be a positive number of seconds, "
                                  f"got {value!r}")

    def transport(self, config: TransportConfig | None = None) -> TransportConfig:
        """``config`` (default: the defaults) with this object's handshake and peer timeouts."""
        base = config if config is not None else TransportConfig()
        return dataclasses.replace(base, handshake_timeout_s=float(self.handshake_s),
                                   peer_timeout_s=float(self.peer_s),
                                   heartbeat_interval_s=min(base.heartbeat_interval_s, self.peer_s / 3))
