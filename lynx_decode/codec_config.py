"""Codec configuration: schemes, split rules, streams, backends, and the frozen
:class:`CodecConfig` that combines them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lynx_decode.errors import CodecError

__all__ = ["Scheme", "Split", "Stream", "Backend", "CodecConfig", "MIN_BITS", "MAX_BITS", "ANCHOR_BITS",
           "DEFAULT_ANCHOR_BITS"]

#: The anchor widths the codec supports: the one definition every layer, config and
#: CLI flag takes the range from (1 bit is too coarse to draft on; at 7 the residual
#: is a single bit and splitting saves almost nothing).
MIN_BITS = 2
MAX_BITS = 6
ANCHOR_BITS = range(MIN_BITS, MAX_BITS + 1)
DEFAULT_ANCHOR_BITS = 4


class Scheme(enum.Enum):
    """What a layer is encoded as on the wire."""

    BF16 = "bf16"  #: passthrough, bfloat16 (round to nearest even from fp32)
    FP16 = "fp16"  #: passthrough, float16
    INT8 = "int8"  #: 8-bit codes + fp16 scale/zero, one buffer on the anchor stream
    INT4 = "int4"  #: 4-bit codes quantized directly from the float input, packed
    LYNX = "lynx"  #: 8-bit codes split into anchor (top `bits`) and residual streams


class Split(enum.Enum):
    """How the 8-bit grid is chosen so that its top ``b`` bits are a good b-bit code.

    ``MSB``: plain INT8 over ``[min, max]`` (255 steps); the anchor is the top ``b``
    bits and anchor-only reconstruction takes the centre of the missing bits,
    code ``a * 2**r + (2**r - 1) / 2``.
    ``ROUNDED`` (QuantSpec-style): the 8-bit grid is shifted and stretched so that
    the top ``b`` bits equal the rounded b-bit quantization of ``[min, max]`` and
    the low bits a signed correction; anchor-only reconstruction is exactly that
    b-bit level, code ``a * 2**r + 2**(r - 1)``.
    """

    MSB = "msb"
    ROUNDED = "rounded"


class Stream(enum.Enum):
    """The lane a buffer travels on."""

    ANCHOR = "anchor"  #: high priority: anchors, scales, zero points (or the whole baseline)
    RESIDUAL = "residual"  #: low priority: the residual bits (LYNX only)


class Backend(enum.Enum):
    """Which implementation runs the codec. Only ``AUTO`` falls back."""

    AUTO = "auto"  #: numpy arrays -> NUMBA (NUMPY if numba is missing); cupy arrays -> CUPY
    NUMPY = "numpy"  #: the reference that defines the format
    NUMBA = "numba"  #: CPU kernels (lynx_kernels.cpu_codec)
    CUPY = "cupy"  #: CUDA kernels (lynx_kernels/codec.cu)


@dataclass(frozen=True)
class CodecConfig:
    """How to encode one layer.

    ``bits`` is the anchor width b of LYNX (residual = 8 - b bits); ``split`` and
    ``bits`` also define the INT8 grid, so LYNX anchor+residual decodes bit-for-bit
    to INT8 with the same config. ``k_group`` tokens share a K scale per channel;
    ``v_group`` channels share a V scale per token.
    """

    scheme: Scheme = Scheme.LYNX
    bits: int = DEFAULT_ANCHOR_BITS
    k_group: int = 64
    v_group: int = 64
    split: Split = Split.MSB

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, Scheme):
            raise CodecError(f"scheme must be a Scheme, got {self.scheme!r}")
        if not isinstance(self.split, Split):
            raise CodecError(f"split must be a Split, got {self.split!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise CodecError(f"bits must be an int, got {self.bits!r}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise CodecError(f"bits={self.bits} is out of range: anchor bits must be in {MIN_BITS}..{MAX_BITS}")
        for name in ("k_group", "v_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
                raise CodecError(f"{name} must be an int in 1..65536, got {value!r}")
