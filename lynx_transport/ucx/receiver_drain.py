"""Refused streams whose chunks were already on their way: received into scratch memory.

A sender that opened a stream with ``OPEN_SENT`` sent its chunks without waiting
for ACCEPT; when the receiver refuses that stream (a manifest over its limits, no
pool space within ``pool_wait_s``, the connection's end), those chunks still wait
in UCX. :class:`Drains` posts a receive for every chunk of the manifest into one
scratch buffer, so the sender's sends finish and nothing stays queued in UCX; the
sender's CANCEL (sent once its sends finished) or the connection's end hands the
receives, the token and the scratch to the quarantine, which cancels what is left.
Owned by the ``lynx-rx-io`` thread (:mod:`lynx_transport.ucx.receiver_loop`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lynx_transport.errors import ManifestError, ProtocolError
from lynx_transport.protocol.clock import Clock
from lynx_transport.protocol.manifest import Manifest, ManifestLimits, decode_manifest
from lynx_transport.protocol.wire import stream_token
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.receiver_quarantine import Quarantine
from lynx_transport.ucx.receiver_rail import RailLoop, post_drain
from lynx_transport.ucx.receiver_state import RxPeer

__all__ = ["Drains"]

#: What a refused ``OPEN_SENT`` manifest is read with to find its chunks: any well-formed
#: manifest the frame limit lets through (the configured limits refused it already).
_DRAIN_LIMITS = ManifestLimits(max_regions=1 << 20, max_name_bytes=1 << 16,
                               max_metadata_bytes=1 << 30, max_total_bytes=1 << 62)


class Drains:
    def __init__(self, worker: UcxWorker, rails: Sequence[RailLoop], quarantine: Quarantine,
                 clock: Clock) -> None:
        self.worker, self.rails, self.quarantine, self.clock = worker, rails, quarantine, clock

    def start(self, conn: RxPeer, sid: int, manifest: Manifest | bytes | None) -> None:
        """Drain stream ``sid`` of ``conn`` if it was opened with ``OPEN_SENT`` (``manifest``:
        its manifest, or the payload to read it from); ``ProtocolError`` if that cannot be
        read (its chunks cannot be told apart)."""
        if sid not in conn.sent:
            return
        conn.sent.discard(sid)
        conn.early_sums.pop(sid, None)
        if not isinstance(manifest, Manifest):
            try:
                manifest = decode_manifest(manifest or b"", _DRAIN_LIMITS)
            except ManifestError as exc:
                raise ProtocolError(f"malformed OPEN_SENT manifest for stream {sid}: {exc}") from exc
        token = stream_token(conn.key, sid)
        self.quarantine.take_token(token)
        requests, scratch = post_drain(self.worker, self.rails, manifest, token)
        conn.draining[sid] = (token, requests, scratch)

    def end(self, conn: RxPeer, sid: int) -> None:
        """No more chunks of drained stream ``sid`` can come: to the quarantine with it."""
        entry = conn.draining.pop(sid, None)
        if entry is not None:
            token, requests, scratch = entry
            self.quarantine.hold(self.clock.now(), [], requests, token, scratch)
