"""vLLM's paged KV blocks as per-layer ``[kv_heads, tokens, head_dim]`` K and V.

vLLM's CPU attention backend gives each layer one tensor
``[num_blocks, kv_heads, block_size, 2 * head_size]``; for the ``vec`` kernels
(x86 without AMX, head sizes divisible by 32) each ``(block, head)`` cell holds
K *transposed*, ``[head_size, block_size]``, then V, ``[block_size, head_size]``
(``cpu_attn.py`` views the cell as ``[2 * block_size, head_size]`` and hands the
halves to ``cpu_attn_reshape_and_cache``; the transposition was measured
against transformers' K for the same weights, see ``tests/vllm``). Indexing a
token as ``tensor[block, :, offset]`` (vLLM's example connector) therefore
reads neither its K nor its V. Other layouts (AMX, ``vec16``, GPU backends) are
refused by :func:`check_layout` rather than guessed.

Token ``t`` of a request lives in block ``block_ids[t // block_size]`` at offset
``t % block_size``.

bfloat16 <-> float32 go through the bits (:func:`to_float32`, and round to nearest
even on the way in): exact, and on this machine's torch about 200x faster than
``tensor.float()`` / ``.to(torch.bfloat16)`` (17 ms for one SmolLM2 layer's K at
2k tokens, which made a save or a load of 30 layers cost a second).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from lynx_vllm.errors import ConnectorError

__all__ = ["VERIFIED_ISAS", "blocks_of", "check_layout", "gather", "scatter", "to_float32"]

#: The CPU attention layouts this module reads and writes.
VERIFIED_ISAS = frozenset({"vec"})


def check_layout(kv: Any, *, block_size: int, isa: str | None) -> tuple[int, int]:
    """``(kv_heads, head_size)`` of a layer tensor, or :class:`ConnectorError` if its layout is not one
    this module knows (``isa``: the CPU attention kernel vLLM chose for the layer)."""
    if kv.device.type != "cpu":
        raise ConnectorError(f"LynxConnector supports vLLM's CPU backend only; this cache is on {kv.device}")
    if isa not in VERIFIED_ISAS:
        raise ConnectorError(f"LynxConnector reads vLLM's CPU KV blocks in the {sorted(VERIFIED_ISAS)} layout; "
                             f"this host's attention kernel is {isa!r} (its block layout is not verified)")
    if kv.dim() != 4 or kv.shape[2] != block_size or kv.shape[3] % 2:
        raise ConnectorError(f"unexpected CPU KV cache shape {tuple(kv.shape)} for block size {block_size} "
                             "(expected [num_blocks, kv_heads, block_size, 2 * head_size])")
    if not kv.is_contiguous():
        raise ConnectorError("vLLM's KV cache tensor is not contiguous")
    return int(kv.shape[1]), int(kv.shape[3]) // 2


def _cells(kv: Any) -> tuple[Any, Any]:
    """K cells ``[blocks, heads, head_size, block_size]`` and V cells ``[blocks, heads, block_size, head_size]``
    (views of ``kv``)."""
    blocks, heads, size, dim2 = kv.shape
    dim = dim2 // 2
    cells = kv.view(blocks, heads, 2, size * dim)
    return cells[:, :, 0].view(blocks, heads, dim, size), cells[:, :, 1].view(blocks, heads, size, dim)


def _spans(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """``(block, first offset, last offset + 1, token of the first offset)`` covering tokens ``[start, end)``."""
    if not 0 <= start <= end:
        raise ConnectorError(f"bad token range [{start}, {end})")
    if end > len(block_ids) * block_size:
        raise ConnectorError(f"tokens [{start}, {end}) need {-(-end // block_size)} blocks, "
                             f"the request has {len(block_ids)}")
    out = []
    t = start
    while t < end:
        i, off = divmod(t, block_size)
        stop = min(block_size, off + (end - t))
        out.append((int(block_ids[i]), off, stop, t))
        t += stop - off
    return out


def gather(kv: Any, block_ids: Sequence[int], start: int, end: int) -> tuple[Any, Any]:
    """K and V of tokens ``[start, end)`` as new ``[kv_heads, end - start, head_size]`` tensors (kv's dtype)."""
    import torch  # noqa: PLC0415 - torch loads only with vLLM; this package imports without it

    k_cells, v_cells = _cells(kv)
    spans = _spans(block_ids, kv.shape[2], start, end)
    heads, dim = kv.shape[1], kv.shape[3] // 2
    k = torch.empty((heads, end - start, dim), dtype=kv.dtype)
    v = torch.empty((heads, end - start, dim), dtype=kv.dtype)
    for block, a, b, t in spans:
        k[:, t - start : t - start + b - a] = k_cells[block, :, :, a:b].transpose(1, 2)
        v[:, t - start : t - start + b - a] = v_cells[block, :, a:b]
    return k, v


def to_float32(t: Any) -> np.ndarray:
    """A torch tensor as a float32 NumPy array (exact for bfloat16, fp16 and fp32)."""
    import torch  # noqa: PLC0415 - torch loads only with vLLM

    if t.dtype == torch.bfloat16:
        bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(t.float().numpy())


def _as_cache(x: Any, dtype: Any) -> Any:
    """``x`` (a float32 NumPy array, or a torch tensor) as a torch tensor of the cache's ``dtype``."""
    import torch  # noqa: PLC0415

    if isinstance(x, np.ndarray):
        if dtype == torch.bfloat16 and x.dtype == np.float32:
            bits = np.ascontiguousarray(x).view(np.uint32)
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # round to nearest even (finite values)
            return torch.from_numpy(rounded.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.to(dtype)


def blocks_of(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The blocks tokens ``[start, end)`` live in (what a write of them touches), in token order."""
    return [block for block, _, _, _ in _spans(block_ids, block_size, start, end)]


def scatter(kv: Any, block_ids: Sequence[int], start: int, k: Any, v: Any, *,
            allowed: Collection[int] | None = None) -> None:
    """Write ``k``/``v`` (``[kv_heads, n, head_size]``: float32 NumPy arrays, as the codec decodes them,
    or torch tensors) as tokens ``[start, start + n)``, in the cache's dtype (bfloat16 rounded to nearest
    even, as torch rounds).

    ``allowed``: the only blocks the write may touch (an asynchronous load, which writes from a thread
    of its own while the engine runs other requests on the same tensor): :class:`ConnectorError`,
    before anything is written, if the tokens live in any other block."""
    k_cells, v_cells = _cells(kv)
    n = k.shape[1]
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != kv.shape[1] or 2 * k.shape[2] != kv.shape[3]:
        raise ConnectorError(f"K/V of shape {tuple(k.shape)}/{tuple(v.shape)} do not fit the cache "
                             f"{tuple(kv.shape)}")
    spans = _spans(block_ids, kv.shape[2], start, start + n)
    if allowed is not None:
        stray = sorted({block for block, _, _, _ in spans} - set(allowed))
        if stray:
            raise ConnectorError(f"tokens [{start}, {start + n}) live in blocks {stray}, which the load does not "
                                 "own (shared or cached blocks are never written by an asynchronous load)")
    k, v = _as_cache(k, kv.dtype), _as_cache(v, kv.dtype)
    for block, a, b, t in spans:
        k_cells[block, :, :, a:b] = k[:, t - start : t - start + b - a].transpose(1, 2)
        v_cells[block, :, a:b] = v[:, t - start : t - start + b - a]
