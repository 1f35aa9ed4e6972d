"""What a decode node asks a prefill node for, and how a refusal comes back.

A request is a one-region transport stream to the prefill node's listener: the
region ``prompt`` holds the prompt (UTF-8 text, or int32 token ids), the stream
metadata a :class:`KVRequest` (JSON). The prefill node answers by connecting to
``reply_to`` and sending either the KV stream (:mod:`lynx_decode.kvheader`) or
an empty stream whose metadata is an error reply (:func:`error_reply`), so the
decode node never waits out a timeout for a request that failed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from lynx_decode.codec.config import Scheme, check_planes
from lynx_decode.errors import CodecError, DecodeError
from lynx_transport.errors import ConfigError

__all__ = ["KVRequest", "PromptKind", "error_reply", "parse_error_reply", "MAX_PROMPT_BYTES", "BUSY_PREFIX"]

REQUEST_FORMAT = "lynx-kv-request"
ERROR_FORMAT = "lynx-kv-error"
VERSION = 2  # 2: planes (the LYNX split) instead of anchor_bits
MAX_PROMPT_BYTES = 4 << 20
MAX_TEXT = 2048

PromptKind = str  # "text" | "chat" | "ids"
_KINDS = ("text", "chat", "ids")


@dataclasses.dataclass(frozen=True)
class KVRequest:
    """A request for the KV cache of a prompt, encoded with ``scheme``.

    ``kind``: ``"text"`` (tokenized as is), ``"chat"`` (wrapped in the model's chat
    template as one user message) or ``"ids"`` (int32 token ids).
    ``bandwidth_gbps``: the sender holds this stream's link to that rate (None:
    unshaped). ``planes``: the LYNX split (widths from the top bit, e.g. ``(4, 4)``).
    ``hold_residual``: the prefill node sends the lanes after the anchor's only
    once the decode node releases them (``ReceiveStream.release_lane``), so their
    transfer does not compete with the first model step for the decode node's
    CPU (LYNX only; the decode node releases them on its first token).
    """

    request_id: str
    scheme: Scheme
    planes: tuple[int, ...]
    kind: PromptKind
    reply_to: tuple[str, int]
    bandwidth_gbps: float | None = None
    hold_residual: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"prompt kind must be one of {_KINDS}, got {self.kind!r}")
        try:
            object.__setattr__(self, "planes", check_planes(self.planes))
        except CodecError as exc:
            raise ConfigError(str(exc)) from None
        bw = self.bandwidth_gbps
        if bw is not None and not (bw > 0 and math.isfinite(bw)):
            raise ConfigError(f"bandwidth must be a positive number of Gbit/s, got {bw}")

    def to_metadata(self) -> bytes:
        return json.dumps({"format": REQUEST_FORMAT, "version": VERSION,
                           "request_id": self.request_id, "scheme": self.scheme.value,
                           "planes": list(self.planes), "kind": self.kind,
                           "reply_to": list(self.reply_to),
                           "bandwidth_gbps": self.bandwidth_gbps,
                           "hold_residual": self.hold_residual}).encode()

    @classmethod
    def from_metadata(cls, data: bytes) -> KVRequest:
        """Parse and validate; :class:`DecodeError` naming what is wrong."""
        try:
            obj: Any = json.loads(bytes(data))
        except ValueError as exc:
            raise DecodeError(f"request metadata is not JSON: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != REQUEST_FORMAT:
            raise DecodeError("stream metadata is not a Lynx KV request")
        if obj.get("version") != VERSION:
            raise DecodeError(f"request version {obj.get('version')!r} is not supported")
        try:
            host, port = obj["reply_to"]
            bw = obj["bandwidth_gbps"]
            hold = obj.get("hold_residual", False)
            if not isinstance(hold, bool):
                raise TypeError(f"hold_residual must be a boolean, got {hold!r}")
            planes = obj["planes"]
            if not isinstance(planes, list):
                raise TypeError(f"planes must be a list, got {planes!r}")
            return cls(str(obj["request_id"]), Scheme(obj["scheme"]), tuple(int(w) for w in planes),
                       str(obj["kind"]), (str(host), int(port)),
                       None if bw is None else float(bw), hold)
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise DecodeError(f"request field is missing or invalid: {exc}") from None


#: An error reply whose message starts with this says the prefill node is at its
#: admission limit (the decode node raises ``ServerBusyError``): retry later.
BUSY_PREFIX = "busy: "


def error_reply(request_id: str, message: str) -> bytes:
    """Metadata of the empty stream that tells a decode node its request failed."""
    return json.dumps({"format": ERROR_FORMAT, "version": VERSION, "request_id": request_id,
                       "message": message[:MAX_TEXT]}).encode()


def parse_error_reply(data: bytes) -> tuple[str, str] | None:
    """``(request_id, message)`` if ``data`` is an error reply, else None."""
    try:
        obj = json.loads(bytes(data))
    except ValueError:
        return None
    if isinstance(obj, dict) and obj.get("format") == ERROR_FORMAT:
        return str(obj.get("request_id")), str(obj.get("message"))[:MAX_TEXT]
    return None
