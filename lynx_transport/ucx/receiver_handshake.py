"""The receiver's side of the handshake: HELLO [-> CHALLENGE, PROOF] -> WELCOME or DENIED.

The decisions are :func:`lynx_transport.protocol.auth.receiver_step`'s; this module
acts on them for :class:`~lynx_transport.ucx.receiver_loop.RxLoop` (its I/O thread):
a WELCOME carries the UCX worker addresses (one per rail), the requested rate, the
connection's key for its tags and the largest ``OPEN_SENT`` manifest taken.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from lynx_transport.config import TransportConfig
from lynx_transport.errors import AuthenticationError, TransportError
from lynx_transport.protocol import auth
from lynx_transport.protocol.shaper import Rate
from lynx_transport.protocol.wire import Frame, FrameType, OversizedFrame, WelcomeFlags, pack_stream_text, pack_welcome
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.heartbeat import Heartbeats
from lynx_transport.ucx.receiver_quarantine import Quarantine
from lynx_transport.ucx.receiver_rail import RailLoop
from lynx_transport.ucx.receiver_state import RxPeer

__all__ = ["on_handshake"]

log = logging.getLogger("lynx_transport")


class RxLoop(Protocol):
    """What the handshake uses of :class:`~lynx_transport.ucx.receiver_loop.RxLoop`."""

    config: TransportConfig
    max_payload: int
    requested_rate: Rate | None
    worker: UcxWorker
    quarantine: Quarantine
    heartbeats: Heartbeats | None

    @property
    def rails(self) -> Sequence[RailLoop]: ...
    def send(self, conn: RxPeer, ftype: FrameType, payload: bytes = b"") -> None: ...
    def drop_conn(self, conn: RxPeer, exc: TransportError, quiet: bool = False) -> None: ...


def on_handshake(loop: RxLoop, conn: RxPeer, frame: Frame | OversizedFrame) -> None:
    """One frame of a connection still in the handshake."""
    step = auth.receiver_step(loop.config.secret, conn.challenge, frame)
    if step.deny is not None:
        _deny(loop, conn, step.deny)
    elif step.challenge is not None:
        conn.challenge = step.challenge
        loop.send(conn, FrameType.CHALLENGE, step.challenge_payload)
    else:
        conn.challenge = None
        _welcome(loop, conn)


def _welcome(loop: RxLoop, conn: RxPeer) -> None:
    conn.hello = True
    conn.ctl.limit(loop.max_payload)
    rate = loop.requested_rate
    flags = WelcomeFlags.CHUNK_SUMS if loop.config.verify_chunks else WelcomeFlags.NONE
    addresses = [loop.worker.address] + [rail.worker.address for rail in loop.rails]
    conn.key = loop.quarantine.alloc_key()
    loop.send(conn, FrameType.WELCOME, pack_welcome(
        addresses, rate.gbps if rate else 0.0, rate.burst_bytes if rate else 0, flags,
        conn.key, loop.max_payload))
    # only now: the heartbeat thread must not put a HEARTBEAT before the WELCOME
    if loop.heartbeats is not None:
        loop.heartbeats.add(conn.ctl)


def _deny(loop: RxLoop, conn: RxPeer, why: str) -> None:
    """Refuse an unauthenticated peer: logged with its address, told why, disconnected."""
    log.warning("refused connection from %s: authentication failed (%s)", conn.ctl.peer, why)
    try:
        loop.send(conn, FrameType.DENIED, pack_stream_text(0, 0, why))
    except TransportError:
        pass
    loop.drop_conn(conn, AuthenticationError(f"peer {conn.ctl.peer}: {why}"), quiet=True)
