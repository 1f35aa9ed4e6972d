"""vLLM's paged KV blocks as per-layer ``[kv_heads, tokens, head_dim]`` K and V.

vLLM's CPU attention backend gives each layer one tensor
``[num_blocks, kv_heads, block_size, 2 * head_size]``; for the ``vec`` kernels
(x86 without AMX, head sizes divisible by 32) each ``(block, head)`` cell holds
K *transposed*, ``[head_size, block_size]``, then V, ``[block_size, head_size]``
(``cpu_attn.py`` views the cell as ``[2 * block_size, head_size]`` and hands the
halves to ``cpu_attn_reshape_and_cache``; the transposition was measured
against transformers' K for the same weights, see ``tests/vllm``). Indexing a
token as ``tensor[block, :, offset]`` (vLLM's example connector) therefore
reads neither its K nor its V. Every other CPU kernel's layout (``amx`` on hosts with
AMX tiles: bf16 pairs interleaved for the tile loads; ``vec16``) is *measured*, not
guessed: :func:`probe_layout` has vLLM's own ``cpu_attn_reshape_and_cache`` write a
block of known values and reads back where each token's K and V landed
(:class:`BlockLayout`); one that is not a permutation of the cell, and GPU caches,
are refused.

Token ``t`` of a request lives in block ``block_ids[t // block_size]`` at offset
``t % block_size``.

bfloat16 <-> float32 go through the bits (:func:`to_float32`, and round to nearest
even on the way in): exact, and on this machine's torch about 200x faster than
``tensor.float()`` / ``.to(torch.bfloat16)`` (17 ms for one SmolLM2 layer's K at
2k tokens, which made a save or a load of 30 layers cost a second).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lynx_vllm.errors import ConnectorError

__all__ = ["VERIFIED_ISAS", "BlockLayout", "blocks_of", "check_layout", "gather", "probe_layout", "scatter",
           "to_float32"]

#: The CPU attention layout this module slices directly (the others are probed).
VERIFIED_ISAS = frozenset({"vec"})

#: ``write(key, value, key_cache, value_cache, slot_mapping)``: vLLM's cache write for one ISA.
CacheWrite = Callable[[Any, Any, Any, Any, Any], None]


@dataclass(frozen=True)
class BlockLayout:
    """Where token ``t``'s dimension ``d`` sits in one ``(block, head)`` cell: ``k_pos[t, d]``
    into the cell's K half, ``v_pos[t, d]`` into its V half (``block_size * head_size``
    elements each), as measured by :func:`probe_layout` for the kernel ``isa``."""

    isa: str
    k_pos: np.ndarray
    v_pos: np.ndarray


def probe_layout(isa: str, block_size: int, head_size: int, dtype: Any, write: CacheWrite) -> BlockLayout:
    """Measure kernel ``isa``'s block layout: ``write`` (vLLM's own cache write) stores one
    block of tokens whose values spell each ``(token, dim)`` index in base-256 digits (exact
    in bf16), twice; where each index lands is the layout. :class:`ConnectorError` unless
    both halves are a permutation of the cell."""
    import torch  # noqa: PLC0415 - torch loads only with vLLM

    n = block_size * head_size
    if n > 256 ** 2:
        raise ConnectorError(f"cannot probe a block of {block_size} x {head_size}")
    index = torch.arange(n).view(block_size, 1, head_size)
    code = torch.zeros((2, n), dtype=torch.int64)
    for digit in range(2 if n > 256 else 1):
        kv = torch.zeros((1, 1, block_size, 2 * head_size), dtype=dtype)
        key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        spelled = ((index // 256 ** digit) % 256).to(dtype)
        write(spelled.contiguous(), spelled.contiguous(), key_cache, value_cache,
              torch.arange(block_size, dtype=torch.int64))
        code += kv.view(2, n).float().round().long() * 256 ** digit
    positions = []
    for half, name in enumerate(("K", "V")):
        at = code[half].numpy()
        if not np.array_equal(np.sort(at), np.arange(n)):
            raise ConnectorError(f"vLLM's {isa!r} attention kernel does not store a block's {name} as a "
                                 "permutation of its values: LynxConnector cannot read or write it")
        positions.append(np.argsort(at).reshape(block_size, head_size))
    return BlockLayout(isa, positions[0], positions[1])


def check_layout(kv: Any, *, block_size: int, isa: str | None,
                 layout: BlockLayout | None = None) -> tuple[int, int]:
    """``(kv_heads, head_size)`` of a layer tensor, or :class:`ConnectorError` if its layout is not one
    this module knows (``isa``: the CPU attention kernel vLLM chose for the layer; ``layout``: its
    probed layout, needed for any kernel but ``vec``)."""
    if kv.device.type != "cpu":
        raise ConnectorError(f"LynxConnector supports vLLM's CPU backend only; this cache is on {kv.device}")
    if isa not in VERIFIED_ISAS and (layout is None or layout.isa != isa):
        raise ConnectorError(f"LynxConnector reads vLLM's CPU KV blocks in the {sorted(VERIFIED_ISAS)} layout, "
                             f"or in one it probed; this host's attention kernel is {isa!r} and was not probed")
    if kv.dim() != 4 or kv.shape[2] != block_size or kv.shape[3] % 2:
        raise ConnectorError(f"unexpected CPU KV cache shape {tuple(kv.shape)} for block size {block_size} "
                             "(expected [num_blocks, kv_heads, block_size, 2 * head_size])")
    if not kv.is_contiguous():
        raise ConnectorError("vLLM's KV cache tensor is not contiguous")
    if layout is not None and layout.k_pos.shape != (block_size, kv.shape[3] // 2):
        raise ConnectorError(f"the probed layout is for blocks of {layout.k_pos.shape}, the cache's are "
                             f"{(block_size, kv.shape[3] // 2)}")
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


def _flat_cells(kv: Any) -> tuple[Any, Any]:
    """K and V halves of every cell, flat: ``[blocks, heads, block_size * head_size]`` (views)."""
    blocks, heads, size, dim2 = kv.shape
    cells = kv.view(blocks, heads, 2, size * (dim2 // 2))
    return cells[:, :, 0], cells[:, :, 1]


def _positions(layout: BlockLayout, a: int, b: int) -> tuple[Any, Any]:
    import torch  # noqa: PLC0415

    return (torch.from_numpy(np.ascontiguousarray(layout.k_pos[a:b]).reshape(-1)),
            torch.from_numpy(np.ascontiguousarray(layout.v_pos[a:b]).reshape(-1)))


def gather(kv: Any, block_ids: Sequence[int], start: int, end: int,
           layout: BlockLayout | None = None) -> tuple[Any, Any]:
    """K and V of tokens ``[start, end)`` as new ``[kv_heads, end - start, head_size]`` tensors (kv's dtype),
    from the ``vec`` layout, or ``layout`` (probed)."""
    import torch  # noqa: PLC0415 - torch loads only with vLLM; this package imports without it

    spans = _spans(block_ids, kv.shape[2], start, end)
    heads, dim = kv.shape[1], kv.shape[3] // 2
    k = torch.empty((heads, end - start, dim), dtype=kv.dtype)
    v = torch.empty((heads, end - start, dim), dtype=kv.dtype)
    if layout is not None:
        k_flat, v_flat = _flat_cells(kv)
        for block, a, b, t in spans:
            kp, vp = _positions(layout, a, b)
            k[:, t - start : t - start + b - a] = k_flat[block][:, kp].view(heads, b - a, dim)
            v[:, t - start : t - start + b - a] = v_flat[block][:, vp].view(heads, b - a, dim)
        return k, v
    k_cells, v_cells = _cells(kv)
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
        x = np.ascontiguousarray(x)
        x = torch.from_numpy(x if x.flags.writeable else x.copy())
    return x.to(dtype)  # float32 to bfloat16: rounded to nearest even, in one pass (a fifth of NumPy's bit arithmetic)


def blocks_of(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """The blocks tokens ``[start, end)`` live in (what a write of them touches), in token order."""
    return [block for block, _, _, _ in _spans(block_ids, block_size, start, end)]


def scatter(kv: Any, block_ids: Sequence[int], start: int, k: Any, v: Any, *,
            allowed: Collection[int] | None = None, layout: BlockLayout | None = None) -> None:
    """Write ``k``/``v`` (``[kv_heads, n, head_size]``: float32 NumPy arrays, as the codec decodes them,
    or torch tensors) as tokens ``[start, start + n)``, in the cache's dtype (bfloat16 rounded to nearest
    even, as torch rounds), in the ``vec`` layout or ``layout`` (probed).

    ``allowed``: the only blocks the write may touch (an asynchronous load, which writes from a thread
    of its own while the engine runs other requests on the same tensor): :class:`ConnectorError`,
    before anything is written, if the tokens live in any other block."""
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
    if layout is not None:
        k_flat, v_flat = _flat_cells(kv)
        heads = kv.shape[1]
        for block, a, b, t in spans:
            kp, vp = _positions(layout, a, b)
            k_flat[block][:, kp] = k[:, t - start : t - start + b - a].reshape(heads, -1)
            v_flat[block][:, vp] = v[:, t - start : t - start + b - a].reshape(heads, -1)
        return
    k_cells, v_cells = _cells(kv)
    for block, a, b, t in spans:
        k_cells[block, :, :, a:b] = k[:, t - start : t - start + b - a].transpose(1, 2)
        v_cells[block, :, a:b] = v[:, t - start : t - start + b - a]
