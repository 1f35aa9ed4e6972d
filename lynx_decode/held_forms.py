"""A prompt's cache as the prefill node holds it (:class:`HeldForms`): its
encoded forms, and the float32 cache when the node keeps it."""

from __future__ import annotations

import dataclasses

from lynx_decode.codec.config import CodecConfig, Scheme
from lynx_decode.kvencode import EncodedCache
from lynx_decode.model.protocol import Prefill

__all__ = ["HeldForms", "form_name"]


@dataclasses.dataclass
class HeldForms:
    """A prompt's cache as the node holds it: its encoded forms, and the float32
    cache when ``hold_native`` (or while it is being encoded)."""

    encoded: dict[CodecConfig, EncodedCache]
    native: Prefill | None

    @property
    def nbytes(self) -> int:
        native = 0 if self.native is None else self.native.kv.keys.nbytes + self.native.kv.values.nbytes
        return native + sum(e.nbytes for e in self.encoded.values())

    def describe(self) -> str:
        forms = [form_name(c) for c in self.encoded] + (["float32"] if self.native is not None else [])
        return f"{self.nbytes / 1e6:.1f} MB held ({', '.join(forms)})"


def form_name(config: CodecConfig) -> str:
    """``int8``, ``lynx 4,4``, ...: a codec form as the node's log lines name it."""
    bits = f" {','.join(map(str, config.planes))}" if config.scheme is Scheme.LYNX else ""
    return f"{config.scheme.value}{bits}"
