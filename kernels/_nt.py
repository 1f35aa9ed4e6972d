"""Numba intrinsics: non-temporal (streaming) stores, fp32 bit casts and fp16
conversions.

Packing kernels write each output byte once and never read it back, so a store
that bypasses the cache (x86 ``movnti``) saves the read-for-ownership of the
destination line -- the same trick ``memcpy`` uses for large copies. Streaming
stores are weakly ordered: every worker ends its share of a kernel with
:func:`store_fence` before the results are handed to another thread.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic as _intrinsic

__all__ = ["stream_store", "store_fence", "f32_bits", "f32_from_bits", "f16_round", "f16_widen"]

# numba types an intrinsic as its typing function (typingctx first), but jitted code calls
# it without typingctx: to mypy the intrinsics here are plain untyped callables.
intrinsic: Any = _intrinsic


@intrinsic
def stream_store(typingctx, arr, idx, val):  # pragma: no cover - compiled
    """``arr[idx] = val`` with a non-temporal hint (contiguous 1-D ``arr``)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        arrty, _idxty, valty = signature.args
        ary = context.make_array(arrty)(context, builder, args[0])
        value = context.cast(builder, args[2], valty, arrty.dtype)
        store = builder.store(value, builder.gep(ary.data, [args[1]]))
        store.set_metadata("nontemporal", builder.module.add_metadata([context.get_constant(types.int32, 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):  # pragma: no cover - compiled
    """A full memory fence (x86 ``mfence``): earlier streaming stores become visible."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f32_bits(typingctx, x):  # pragma: no cover - compiled
    """The IEEE bit pattern (uint32) of a float32 value."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def f32_from_bits(typingctx, u):  # pragma: no cover - compiled
    """The float32 value of an IEEE bit pattern (uint32)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@intrinsic
def f16_round(typingctx, x):  # pragma: no cover - compiled
    """fp16 bit pattern (uint16) of a float32 value, rounded to nearest even (IEEE
    ``fptrunc``: one F16C instruction on x86)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return sig, codegen


@intrinsic
def f16_widen(typingctx, h):  # pragma: no cover - compiled
    """float32 value of an fp16 bit pattern (uint16), exactly."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen
