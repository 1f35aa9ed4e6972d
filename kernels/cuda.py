"""Loader for the CUDA kernels in ``codec.cu``: compiled lazily with CuPy's
``RawModule`` (NVRTC) on first use and cached per device. Importing this module
does not import CuPy or touch a GPU.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

__all__ = ["SOURCE", "module", "function"]

SOURCE = Path(__file__).with_name("codec.cu")
_OPTIONS = ("--std=c++17",)
_modules: dict[int, Any] = {}
_lock = threading.Lock()


def module() -> Any:
    """The compiled ``cupy.RawModule`` for the current device."""
    import cupy  # noqa: PLC0415 - optional dependency, only on the GPU path

    device = cupy.cuda.Device().id
    with _lock:
        mod = _modules.get(device)
        if mod is None:
            mod = cupy.RawModule(code=SOURCE.read_text(), options=_OPTIONS)
            mod.compile()
            _modules[device] = mod
    return mod


def function(name: str) -> Any:
    """A kernel (``cupy.RawKernel``) of the current device's module."""
    return module().get_function(name)
