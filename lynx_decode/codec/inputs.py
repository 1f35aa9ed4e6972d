"""Input and output arrays of the codec: NumPy, CuPy, or torch tensors (via DLPack).

Everything is checked here, once, with errors that name the problem: the array
type, dtype (fp32/fp16/bf16), C-contiguity, rank, and K/V shape agreement.
bfloat16 has no NumPy/CuPy dtype, so bf16 data moves as its uint16 bit patterns
(torch bf16 tensors are viewed as int16 before DLPack; ml_dtypes bf16 arrays are
viewed as uint16) and is widened to fp32 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lynx_decode.codec.quant import bf16_bits_to_f32
from lynx_decode.errors import CodecError
from lynx_transport.errors import BackendError

__all__ = ["Tensor", "as_tensor", "as_f32", "as_byte_buffer", "as_output", "array_module"]


@dataclass(frozen=True)
class Tensor:
    """A validated input: ``data`` is a NumPy or CuPy array; ``bf16`` means it
    holds bfloat16 bit patterns (uint16)."""

    data: Any
    xp: Any
    bf16: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 - optional, imported only when a CuPy array arrives
    except ImportError as exc:
        raise BackendError("CuPy is not installed (pip install 'lynx-kv[gpu]')") from exc
    return cupy


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def array_module(x: Any) -> Any:
    """``numpy`` or ``cupy`` for an array of either kind."""
    return _cupy() if _is_cupy(x) else np


def _from_torch(t: Any, name: str) -> tuple[Any, bool]:
    import torch  # noqa: PLC0415 - only reached with a torch tensor in hand

    t = t.detach()
    if not t.is_contiguous():
        raise CodecError(f"{name} is not contiguous (torch strides {tuple(t.stride())}); call .contiguous() first")
    bf16 = t.dtype == torch.bfloat16
    if bf16:
        t = t.view(torch.int16)
    elif t.dtype not in (torch.float32, torch.float16):
        raise CodecError(f"{name} has unsupported dtype {t.dtype}; expected float32, float16 or bfloat16")
    if t.device.type == "cuda":
        return _cupy().from_dlpack(t), bf16
    if t.device.type != "cpu":
        raise CodecError(f"{name} is on device {t.device}; only cpu and cuda tensors are supported")
    return np.from_dlpack(t), bf16


def as_tensor(x: Any, name: str) -> Tensor:
    """Validate one K or V input ``[kv_heads, tokens, head_dim]``."""
    if _is_torch(x):
        data, bf16 = _from_torch(x, name)
    elif isinstance(x, np.ndarray) or _is_cupy(x):
        data, bf16 = x, False
    else:
        raise CodecError(f"{name} must be a NumPy or CuPy array or a torch tensor, got {type(x).__name__}")
    xp = array_module(data)
    if data.dtype.name == "bfloat16" and data.dtype.itemsize == 2:  # ml_dtypes
        data, bf16 = data.view(np.uint16), True
    elif bf16:
        data = data.view(xp.uint16)
    elif data.dtype not in (np.float32, np.float16):
        raise CodecError(f"{name} has unsupported dtype {data.dtype}; expected float32, float16 or bfloat16")
    if not data.flags.c_contiguous:
        raise CodecError(f"{name} is not C-contiguous (strides {data.strides}); pass a contiguous copy")
    if data.ndim != 3:
        raise CodecError(f"{name} must have shape [kv_heads, tokens, head_dim], got shape {tuple(data.shape)}")
    if 0 in data.shape:
        raise CodecError(f"{name} is empty (shape {tuple(data.shape)})")
    return Tensor(data, xp, bf16)


def as_f32(t: Tensor) -> Any:
    """The tensor as fp32 (no copy when it already is)."""
    if t.bf16:
        return bf16_bits_to_f32(t.data, t.xp)
    return t.data if t.data.dtype == np.float32 else t.data.astype(np.float32)


def as_byte_buffer(buf: Any, name: str, need: int, xp: Any) -> Any:
    """A 1-D uint8 view of a received stream buffer holding at least ``need`` bytes."""
    if xp is np and not isinstance(buf, np.ndarray):
        if _is_cupy(buf):
            raise CodecError(f"{name} is a CuPy array but the other inputs are on the host")
        try:
            buf = np.frombuffer(buf, dtype=np.uint8)
        except TypeError:
            raise CodecError(f"{name} must be a uint8 array or a bytes-like object, got {type(buf).__name__}") from None
    elif xp is not np and not _is_cupy(buf):
        raise CodecError(f"{name} must be a CuPy array for the cupy backend, got {type(buf).__name__}")
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise CodecError(f"{name} must be a 1-D uint8 buffer, got dtype {buf.dtype} shape {tuple(buf.shape)}")
    if not buf.flags.c_contiguous:
        raise CodecError(f"{name} is not contiguous")
    if buf.size < need:
        raise CodecError(f"{name} holds {buf.size} bytes but the layout needs {need}")
    if xp is not np and buf.data.ptr % 8:
        raise CodecError(
            f"{name} must start on an 8-byte boundary for the CUDA kernels (layout offsets are {64}-aligned)"
        )
    return buf[:need]


def as_output(out: Any, name: str, shape: tuple[int, ...], xp: Any) -> Any:
    """Validate a caller-provided output (NumPy/CuPy array or torch tensor, fp32 or fp16)."""
    if _is_torch(out):
        if out.requires_grad:
            raise CodecError(f"{name} requires grad; pass a tensor outside autograd")
        out = _cupy().from_dlpack(out) if out.device.type == "cuda" else np.from_dlpack(out)
    if array_module(out) is not xp or not hasattr(out, "dtype"):
        raise CodecError(f"{name} must be a {xp.__name__} array like the inputs, got {type(out).__name__}")
    if out.dtype not in (np.float32, np.float16):
        raise CodecError(f"{name} has dtype {out.dtype}; decoded output must be float32 or float16")
    if tuple(out.shape) != shape:
        raise CodecError(f"{name} has shape {tuple(out.shape)}, expected {shape}")
    if not getattr(out.flags, "writeable", True):  # CuPy has no writeable flag
        raise CodecError(f"{name} must be a writable array")
    if not out.flags.c_contiguous and not _heads_contiguous(out):
        raise CodecError(
            f"{name} must be a writable array whose heads are each C-contiguous [tokens, head_dim] blocks "
            f"that do not overlap (strides {tuple(out.strides)})"
        )
    return out


def _heads_contiguous(out: Any) -> bool:
    """True when each ``out[h]`` is a C-contiguous ``[tokens, head_dim]`` block and the
    heads sit a non-negative, non-overlapping whole number of elements apart (a
    per-layer view of a cache with headroom)."""
    heads, tokens, dim = out.shape
    item = out.itemsize
    s0, s1, s2 = out.strides
    if (dim > 1 and s2 != item) or (tokens > 1 and s1 != dim * item):
        return False
    return heads == 1 or (s0 % item == 0 and s0 >= tokens * dim * item)
