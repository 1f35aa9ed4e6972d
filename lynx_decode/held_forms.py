"""A prompt's cache as the prefill node holds it (:class:`HeldForms`): its
encoded forms, and the float32 cache when the node keeps it; which form a pull
is held in (:func:`held_as`: a LYNX split as its INT8 codes)."""

from __future__ import annotations

import dataclasses

from lynx_decode.codec.config import CodecConfig, Scheme, int8_source
from lynx_decode.kvencode import EncodedCache
from lynx_decode.model.protocol import Prefill

__all__ = ["HeldForms", "form_name", "held_as", "DEFAULT_PREPARE"]

#: The forms a prompt's cache is encoded into before any pull asks: INT8, which is also
#: every LYNX split's (:func:`held_as`; an encode is ~2 % of a CPU prefill).
DEFAULT_PREPARE = (CodecConfig(Scheme.INT8),)


def held_as(config: CodecConfig) -> CodecConfig:
    """The form a pull of ``config`` is held in: a LYNX split on the MSB grid as its INT8 codes
    and scales (:func:`~lynx_decode.codec.config.int8_source`), whose planes the send cuts as it
    supplies each layer (:func:`~lynx_decode.codec.api.lynx_from_int8`); any other as itself."""
    return int8_source(config) or config


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
