"""Numba intrinsics for non-temporal (streaming) stores.

Packing kernels write each output byte once and never read it back, so a store
that bypasses the cache (x86 ``movnti``) saves the read-for-ownership of the
destination line -- the same trick ``memcpy`` uses for large copies. Streaming
stores are weakly ordered: every worker ends its share of a kernel with
:func:`store_fence` before the results are handed to another thread.
"""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic

__all__ = ["stream_store", "store_fence"]


@intrinsic
def stream_store(typingctx, arr, idx, val):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """``arr[idx] = val`` with a non-temporal hint (contiguous 1-D ``arr``)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        arrty, _idxty, valty = signature.args
        ary = context.make_array(arrty)(context, builder, args[0])
        value = context.cast(builder, args[2], valty, arrty.dtype)
        store = builder.store(value, builder.gep(ary.data, [args[1]]))
        store.set_metadata("nontemporal", builder.module.add_metadata([context.get_constant(types.int32, 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """A full memory fence (x86 ``mfence``): earlier streaming stores become visible."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen
