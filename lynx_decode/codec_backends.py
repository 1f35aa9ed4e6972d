"""Codec backends: one small class per implementation of the same format.

``ReferenceOps`` (NumPy; defines the format), ``NumbaOps`` (CPU kernels in
``lynx_kernels.cpu_*``) and ``CupyOps`` (CUDA kernels in ``lynx_kernels/codec.cu``,
see :mod:`lynx_decode.codec_cupy`) implement the same :class:`Ops` methods on
arrays of their kind. :func:`select` picks one by the arrays' module or by an
explicit :class:`Backend`; asking for an unavailable backend raises
:class:`BackendError`, and only ``Backend.AUTO`` falls back (Numba -> NumPy).

Code buffers handed between ops are flat uint8 arrays padded with zeros to whole
64-value blocks (``padded(n)`` bytes), so packing kernels never see a tail.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from lynx_decode import codec_pack as pk
from lynx_decode import codec_quant as qt
from lynx_decode.codec_config import Backend
from lynx_transport.errors import BackendError, CodecError

__all__ = ["Ops", "ReferenceOps", "NumbaOps", "select", "padded"]


def padded(n: int) -> int:
    """Bytes of a code buffer of ``n`` values padded to whole blocks."""
    return -(-n // pk.BLOCK) * pk.BLOCK


class Ops:
    """The kernels one backend provides (all arrays of ``self.xp``)."""

    name = "abstract"
    xp: Any = np

    def minmax(self, x: Any, group: int, kind: str, what: str) -> tuple[Any, Any]:
        """fp32 group extremes of fp32 ``x [H,T,D]`` (``kind`` 'k' or 'v')."""
        raise NotImplementedError

    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        """Write uint8 codes of ``x`` into ``out [H,T,D]`` (params fp32, group-shaped)."""
        raise NotImplementedError

    def dequant(self, values: Any, shift: int, offset: float, scale: Any, zero: Any, group: int, kind: str, out: Any) -> None:
        """Write fp32 ``(values*2**shift + offset) * scale + zero`` into ``out [H,T,D]``."""
        raise NotImplementedError

    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        """Padded codes -> packed anchor/residual regions (``packed_size`` bytes each)."""
        raise NotImplementedError

    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        """Packed anchor + residual -> padded 8-bit codes."""
        raise NotImplementedError

    def pack(self, values: Any, width: int, packed: Any) -> None:
        """Padded values -> packed region."""
        raise NotImplementedError

    def unpack(self, packed: Any, width: int, values: Any) -> None:
        """Packed region -> padded values."""
        raise NotImplementedError


class ReferenceOps(Ops):
    """The NumPy reference: the definition of the format."""

    name = "numpy"

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp

    def minmax(self, x: Any, group: int, kind: str, what: str) -> tuple[Any, Any]:
        fn = qt.group_minmax_k if kind == "k" else qt.group_minmax_v
        return fn(x, group, self.xp)

    def _expand(self, p: Any, group: int, kind: str, shape: tuple[int, ...]) -> Any:
        if kind == "k":
            return qt.expand_k(p, group, shape[1], self.xp)
        return qt.expand_v(p, group, shape[2], self.xp)

    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        e = functools.partial(self._expand, group=group, kind=kind, shape=x.shape)
        out[...] = qt.quantize(x, e(inv), e(zero), levels, self.xp)

    def dequant(self, values: Any, shift: int, offset: float, scale: Any, zero: Any, group: int, kind: str, out: Any) -> None:
        e = functools.partial(self._expand, group=group, kind=kind, shape=values.shape)
        out[...] = qt.dequantize(values, shift, offset, e(scale), e(zero), self.xp)

    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        a, r = pk.split(codes, bits, self.xp)
        anchor[...] = a
        residual[...] = r

    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        codes[...] = pk.merge(anchor, residual, codes.size, bits, self.xp)

    def pack(self, values: Any, width: int, packed: Any) -> None:
        packed[...] = pk.pack(values, width, self.xp)

    def unpack(self, packed: Any, width: int, values: Any) -> None:
        values[...] = pk.unpack(packed, values.size, width, self.xp)


def _words(a: Any) -> Any:
    return a.view(np.uint64)


_NUMBA_LOCK = threading.Lock()


def _locked(fn: Any) -> Any:
    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        # Numba's parallel kernels already use every core, and its fallback threading
        # layer (workqueue) aborts on concurrent launches: run one kernel at a time.
        with _NUMBA_LOCK:
            return fn(*args)

    return run


class NumbaOps(Ops):
    """Numba CPU kernels (``parallel=True``, cached on disk). Safe to call from
    several threads: kernel launches are serialised."""

    name = "numba"

    def __init__(self) -> None:
        try:
            from lynx_kernels import cpu_pack, cpu_quant  # noqa: PLC0415 - numba is imported on first use
        except ImportError as exc:
            raise BackendError(f"the numba backend is unavailable: {exc} (pip install numba)") from exc
        self._pack = cpu_pack
        self._quant = cpu_quant

    def minmax(self, x: Any, group: int, kind: str, what: str) -> tuple[Any, Any]:
        heads, tokens, dim = x.shape
        shape = (heads, -(-tokens // group), dim) if kind == "k" else (heads, tokens, -(-dim // group))
        lo = np.empty(shape, np.float32)
        hi = np.empty(shape, np.float32)
        bad = np.zeros(shape[0] * shape[1], np.bool_)
        with _NUMBA_LOCK:
            (self._quant.minmax_k if kind == "k" else self._quant.minmax_v)(x, group, lo, hi, bad)
        if bad.any():
            raise CodecError(f"{what} contains non-finite values (NaN or inf) in {int(bad.sum())} quantization group(s)")
        return lo, hi

    @_locked
    def quantize(self, x: Any, inv: Any, zero: Any, group: int, kind: str, levels: int, out: Any) -> None:
        (self._quant.quantize_k if kind == "k" else self._quant.quantize_v)(x, inv, zero, group, levels, out)

    @_locked
    def dequant(self, values: Any, shift: int, offset: float, scale: Any, zero: Any, group: int, kind: str, out: Any) -> None:
        fn = self._quant.dequant_k if kind == "k" else self._quant.dequant_v
        fn(values, np.float32(1 << shift), np.float32(offset), scale, zero, group, out)

    @_locked
    def split(self, codes: Any, bits: int, anchor: Any, residual: Any) -> None:
        self._pack.split_kernel(bits)(_words(codes), _words(anchor), _words(residual))

    @_locked
    def merge(self, anchor: Any, residual: Any, bits: int, codes: Any) -> None:
        self._pack.merge_kernel(bits)(_words(anchor), _words(residual), _words(codes))

    @_locked
    def pack(self, values: Any, width: int, packed: Any) -> None:
        self._pack.pack_kernel(width)(_words(values), _words(packed))

    @_locked
    def unpack(self, packed: Any, width: int, values: Any) -> None:
        self._pack.unpack_kernel(width)(_words(packed), _words(values))


@functools.cache
def _numba_ops() -> NumbaOps:
    return NumbaOps()


def select(backend: Backend, xp: Any) -> Ops:
    """The ops for ``backend`` on arrays of module ``xp`` (BackendError if unavailable)."""
    if not isinstance(backend, Backend):
        raise CodecError(f"backend must be a Backend, got {backend!r}")
    on_device = xp is not np
    if on_device:
        if backend not in (Backend.AUTO, Backend.CUPY):
            raise BackendError(f"the {backend.value} backend runs on host arrays, but the inputs are CuPy arrays")
        from lynx_decode.codec_cupy import cupy_ops  # noqa: PLC0415 - GPU code only when a GPU array arrives

        return cupy_ops()
    if backend is Backend.CUPY:
        from lynx_decode.codec_cupy import cupy_ops  # noqa: PLC0415

        cupy_ops()  # raises BackendError when CuPy or a device is missing
        raise CodecError("the cupy backend needs CuPy arrays; move the inputs with cupy.asarray first")
    if backend is Backend.NUMPY:
        return ReferenceOps()
    try:
        return _numba_ops()
    except BackendError:
        if backend is Backend.AUTO:
            return ReferenceOps()
        raise
