"""Codec backends: one small class per implementation of the same format.

``ReferenceOps`` (NumPy; defines the format, :mod:`.base`), ``NumbaOps`` (CPU
kernels in ``lynx_kernels.cpu_*``, :mod:`.numba`) and ``CupyOps`` (CUDA kernels in
``lynx_kernels/codec.cu``, :mod:`.cupy`) implement the same :class:`Ops` methods
on arrays of their kind. :func:`select` picks one by the arrays' module or by an
explicit :class:`Backend`; asking for an unavailable backend raises
:class:`BackendError`, and only ``Backend.AUTO`` falls back (Numba -> NumPy).
Importing this package imports neither numba nor cupy: each backend loads its
library when it is first constructed.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from lynx_decode.codec.backends.base import Ops, ReferenceOps, codes_of, levels_of, padded
from lynx_decode.codec.backends.cupy import CupyOps, cupy_ops
from lynx_decode.codec.backends.numba import NumbaOps
from lynx_decode.codec.config import Backend
from lynx_decode.errors import CodecError
from lynx_transport.errors import BackendError

__all__ = ["Ops", "ReferenceOps", "NumbaOps", "CupyOps", "select", "padded", "levels_of", "codes_of"]


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
        return cupy_ops()
    if backend is Backend.CUPY:
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
