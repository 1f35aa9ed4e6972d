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

import hashlib
import hmac

from lynx_transport.wire import MAC_BYTES

__all__ = ["receiver_mac", "sender_mac", "verify"]

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
