"""Shared-secret mutual authentication of the control handshake (pure logic, no sockets).

With a secret configured on both sides the handshake is::

    S -> R  HELLO      flags=AUTH | nonce_s (32 random bytes)
    R -> S  CHALLENGE  nonce_r | HMAC-SHA256(secret, "lynx-rx" | nonce_s | nonce_r)
    S -> R  PROOF      HMAC-SHA256(secret, "lynx-tx" | nonce_r | nonce_s)
    R -> S  WELCOME    (the receiver's UCX worker address, only now)

The receiver proves itself first, so a sender never hands an unauthenticated
worker address to UCX (which does not validate addresses). The two MACs use
different labels, so neither can be reflected back as the other. Every
comparison is constant-time (:func:`hmac.compare_digest`). A receiver that
requires a secret answers a HELLO without ``AUTH``, or a wrong PROOF, with
DENIED and closes; it exposes neither its worker address nor any pool memory
to such a peer. The secret itself never appears in a message, log or repr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets

from lynx_transport.errors import ProtocolError
from lynx_transport.protocol.wire import (
    MAC_BYTES,
    NONCE_BYTES,
    Frame,
    FrameType,
    HelloFlags,
    OversizedFrame,
    pack_challenge,
    unpack_hello,
    unpack_proof,
)

__all__ = ["receiver_mac", "sender_mac", "verify", "HandshakeStep", "receiver_step"]

_RX_LABEL = b"lynx-rx"
_TX_LABEL = b"lynx-tx"


def receiver_mac(secret: bytes, nonce_s: bytes, nonce_r: bytes) -> bytes:
    """What the receiver sends to prove it holds ``secret``."""
    return hmac.new(secret, _RX_LABEL + nonce_s + nonce_r, hashlib.sha256).digest()


def sender_mac(secret: bytes, nonce_r: bytes, nonce_s: bytes) -> bytes:
    """What the sender sends to prove it holds ``secret``."""
    return hmac.new(secret, _TX_LABEL + nonce_r + nonce_s, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two MACs (a wrong length is simply unequal)."""
    assert len(expected) == MAC_BYTES
    return hmac.compare_digest(expected, got)


@dataclasses.dataclass(frozen=True)
class HandshakeStep:
    """What a receiver does with one frame before WELCOME: exactly one field is set.

    ``welcome``: send WELCOME. ``challenge``: remember ``(nonce_s, nonce_r)`` and
    send CHALLENGE (``challenge_payload``). ``deny``: refuse, with this reason.
    """

    welcome: bool = False
    challenge: tuple[bytes, bytes] | None = None
    challenge_payload: bytes = b""
    deny: str | None = None


def receiver_step(secret: bytes | None, challenge: tuple[bytes, bytes] | None,
                  frame: Frame | OversizedFrame) -> HandshakeStep:
    """The receiver's side of HELLO [-> CHALLENGE, PROOF] -> WELCOME.

    ``challenge``: the nonces of a CHALLENGE already sent (awaiting PROOF).
    Raises ``ProtocolError`` for a first frame other than HELLO when no secret is set.
    """
    if isinstance(frame, Frame) and frame.type is FrameType.HELLO and challenge is None:
        flags, nonce_s = unpack_hello(frame.payload)
        if secret is None:
            return HandshakeStep(welcome=True)
        if not flags & HelloFlags.AUTH:
            return HandshakeStep(deny="this receiver requires a shared secret; the sender has none")
        nonce_r = secrets.token_bytes(NONCE_BYTES)
        return HandshakeStep(challenge=(nonce_s, nonce_r), challenge_payload=pack_challenge(
            nonce_r, receiver_mac(secret, nonce_s, nonce_r)))
    if (isinstance(frame, Frame) and frame.type is FrameType.PROOF
            and challenge is not None and secret is not None):
        nonce_s, nonce_r = challenge
        if verify(sender_mac(secret, nonce_r, nonce_s), unpack_proof(frame.payload)):
            return HandshakeStep(welcome=True)
        return HandshakeStep(deny="wrong shared secret")
    if secret is not None:
        return HandshakeStep(deny=f"unexpected {frame.type.name} frame before authentication")
    raise ProtocolError("the first frame on a connection must be HELLO")
