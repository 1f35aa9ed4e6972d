"""Flat byte views of region buffers, shared by the UCX transport and the in-memory twin.

Pure: no UCX. NumPy is imported on first use; CuPy only when a CUDA array arrives.
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_bytes_view"]


def as_bytes_view(buffer: Any) -> Any:
    """A flat ``uint8`` view of a contiguous host (buffer protocol) or CUDA array; no copy.

    Raises ``ValueError`` when the buffer is not C-contiguous.
    """
    if hasattr(buffer, "__cuda_array_interface__"):
        import cupy  # noqa: PLC0415 - optional, imported only when a CUDA array arrives

        arr = cupy.asarray(buffer)
        if not arr.flags.c_contiguous:
            raise ValueError("CUDA region buffers must be C-contiguous")
        return arr.reshape(-1).view(cupy.uint8)
    import numpy as np  # noqa: PLC0415

    arr = np.asarray(memoryview(buffer)) if not isinstance(buffer, np.ndarray) else buffer
    if not arr.flags.c_contiguous:
        raise ValueError("region buffers must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)
