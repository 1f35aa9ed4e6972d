"""Codec configuration: schemes, split rules, the plane table, backends, and the
frozen :class:`CodecConfig` that combines them.

The plane table is the one place that says how a LYNX code is cut: ``planes``
lists the bit widths from the most significant slice down, e.g. ``(4, 4)`` (the
default: a 4-bit anchor and a 4-bit residual), ``(3, 5)`` or ``(2, 2, 4)``. Plane
``i`` carries bits ``shift .. shift + bits - 1`` of every 8-bit code and travels on
lane ``i`` (plane 0, with the scales, first). Every other scheme is one plane.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lynx_decode.errors import CodecError
from lynx_transport.lanes import MAX_LANES

__all__ = ["Scheme", "Split", "Plane", "Backend", "CodecConfig", "MIN_BITS", "MAX_BITS", "ANCHOR_BITS",
           "DEFAULT_ANCHOR_BITS", "MAX_PLANES", "parse_planes", "check_planes", "planes_name", "int8_source"]

#: The anchor widths the codec supports: the one definition every layer, config and
#: CLI flag takes the range from (1 bit is too coarse to draft on; at 7 the residual
#: is a single bit and splitting saves almost nothing).
MIN_BITS = 2
MAX_BITS = 6
ANCHOR_BITS = range(MIN_BITS, MAX_BITS + 1)
DEFAULT_ANCHOR_BITS = 4
#: One lane per plane: a split has at most this many planes.
MAX_PLANES = MAX_LANES


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
    bits, and a prefix of the planes is reconstructed by occ-mean
    (:mod:`lynx_decode.codec.quant`: the centre of the missing bits,
    ``a * 2**r + (2**r - 1) / 2``, except a group's two end bins, pulled towards
    the group's extreme by how many codes share them).
    ``ROUNDED`` (QuantSpec-style): the 8-bit grid is shifted and stretched so that
    the top ``b`` bits equal the rounded b-bit quantization of ``[min, max]`` and
    the low bits a signed correction; anchor-only reconstruction is exactly that
    b-bit level, code ``a * 2**r + 2**(r - 1)``.
    """

    MSB = "msb"
    ROUNDED = "rounded"


class Backend(enum.Enum):
    """Which implementation runs the codec. Only ``AUTO`` falls back."""

    AUTO = "auto"  #: numpy arrays -> NUMBA (NUMPY if numba is missing); cupy arrays -> CUPY
    NUMPY = "numpy"  #: the reference that defines the format
    NUMBA = "numba"  #: CPU kernels (lynx_kernels.cpu_codec)
    CUPY = "cupy"  #: CUDA kernels (lynx_kernels/codec.cu)


@dataclass(frozen=True)
class Plane:
    """One bit slice of the 8-bit code: ``bits`` wide, its lowest bit at ``shift``.
    Plane ``index`` travels on lane ``index``; plane 0 also carries the scales."""

    index: int
    bits: int
    shift: int

    @property
    def lane(self) -> int:
        return self.index

    @property
    def mask(self) -> int:
        return (1 << self.bits) - 1

    @property
    def prefix_bits(self) -> int:
        """Bits of the code known once this plane and every one before it landed."""
        return 8 - self.shift


def check_planes(planes: object) -> tuple[int, ...]:
    """``planes`` as a validated tuple of widths, or :class:`CodecError` naming the
    problem: at least 2 planes, at most :data:`MAX_PLANES` (one lane each), none of
    0 bits, summing to 8, the first (the anchor) in ``MIN_BITS..MAX_BITS``."""
    if isinstance(planes, (str, bytes)) or not hasattr(planes, "__iter__"):
        raise CodecError(f"planes must be a sequence of bit widths, got {planes!r}")
    widths = tuple(planes)
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, int):
            raise CodecError(f"plane widths must be ints, got {widths!r}")
    text = ",".join(str(w) for w in widths)
    if any(w <= 0 for w in widths):
        raise CodecError(f"planes {text}: every plane needs at least 1 bit")
    if len(widths) < 2:
        raise CodecError(f"planes {text}: a split needs at least 2 planes (one plane of 8 bits is INT8)")
    if len(widths) > MAX_PLANES:
        raise CodecError(f"planes {text}: {len(widths)} planes, but there are only {MAX_PLANES} lanes")
    if sum(widths) != 8:
        raise CodecError(f"planes {text} sum to {sum(widths)} bits; a split of the 8-bit code must sum to 8")
    if not MIN_BITS <= widths[0] <= MAX_BITS:
        raise CodecError(f"planes {text}: the anchor (first plane) must have {MIN_BITS}..{MAX_BITS} bits")
    return widths


def parse_planes(text: str) -> tuple[int, ...]:
    """``"2,2,4"`` -> ``(2, 2, 4)``, validated (:func:`check_planes`)."""
    try:
        widths = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise CodecError(f"planes must be comma-separated bit widths like 4,4 or 2,2,4, got {text!r}") from None
    return check_planes(widths)


def planes_name(planes: tuple[int, ...]) -> str:
    """The short name of a split: ``(4, 4)`` -> ``"4"``, ``(3, 5)`` -> ``"3"``,
    ``(2, 2, 4)`` -> ``"2.2.4"`` (two planes are named by the anchor width)."""
    return str(planes[0]) if len(planes) == 2 else ".".join(str(w) for w in planes)


@dataclass(frozen=True)
class CodecConfig:
    """How to encode one layer.

    ``planes`` is LYNX's plane table (widths from the top bit down, summing to 8);
    ``bits`` is the anchor width, ``planes[0]``. Give either (``bits=b`` means
    ``planes=(b, 8 - b)``); both are filled in. ``split`` and ``bits`` also define
    the INT8 grid, so LYNX with every plane decodes bit-for-bit to INT8 with the
    same config. ``k_group`` tokens share a K scale per channel; ``v_group``
    channels share a V scale per token.
    """

    scheme: Scheme = Scheme.LYNX
    bits: int = None  # type: ignore[assignment]  # filled in by __post_init__
    k_group: int = 64
    v_group: int = 64
    split: Split = Split.MSB
    planes: tuple[int, ...] = None  # type: ignore[assignment]  # filled in by __post_init__

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, Scheme):
            raise CodecError(f"scheme must be a Scheme, got {self.scheme!r}")
        if not isinstance(self.split, Split):
            raise CodecError(f"split must be a Split, got {self.split!r}")
        bits = self.bits
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int)):
            raise CodecError(f"bits must be an int, got {bits!r}")
        if bits is not None and not MIN_BITS <= bits <= MAX_BITS:
            raise CodecError(f"bits={bits} is out of range: anchor bits must be in {MIN_BITS}..{MAX_BITS}")
        if self.planes is None:
            bits = DEFAULT_ANCHOR_BITS if bits is None else bits
            planes = (bits, 8 - bits)
        else:
            planes = check_planes(self.planes)
            if bits is not None and bits != planes[0]:
                raise CodecError(f"bits={bits} disagrees with planes {planes} (bits is the first plane)")
        object.__setattr__(self, "bits", planes[0])
        object.__setattr__(self, "planes", planes)
        for name in ("k_group", "v_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
                raise CodecError(f"{name} must be an int in 1..65536, got {value!r}")

    @property
    def plane_table(self) -> tuple[Plane, ...]:
        """The planes of one layer: LYNX's split, or a single plane for every other scheme."""
        return plane_table(self.scheme, self.planes)


def plane_table(scheme: Scheme, planes: tuple[int, ...]) -> tuple[Plane, ...]:
    """The :class:`Plane` list of ``scheme`` with LYNX widths ``planes``."""
    if scheme is not Scheme.LYNX:
        return (Plane(0, {Scheme.INT4: 4, Scheme.INT8: 8}.get(scheme, 16), 0),)
    out, shift = [], 8
    for i, width in enumerate(planes):
        shift -= width
        out.append(Plane(i, width, shift))
    return tuple(out)


def int8_source(config: CodecConfig) -> CodecConfig | None:
    """The INT8 form a LYNX ``config``'s planes can be cut from, bit for bit (same groups), or None
    when they cannot: another scheme, or the ``ROUNDED`` grid (whose scales depend on the anchor
    width). On the default ``MSB`` grid a LYNX layer is the INT8 layer's codes split into planes
    with its scales (:func:`lynx_decode.codec.api.lynx_from_int8`), so one held INT8 cache serves
    every split."""
    if config.scheme is not Scheme.LYNX or config.split is not Split.MSB:
        return None
    return CodecConfig(Scheme.INT8, k_group=config.k_group, v_group=config.v_group)
