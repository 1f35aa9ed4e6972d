"""The hierarchical KV codec: encode a layer's K and V into one buffer per plane,
and decode them from any prefix of the planes (the anchor alone ... all of them).

Format (per layer, ``[kv_heads, tokens, head_dim]`` K and V):

- Asymmetric uniform INT8, KIVI grouping: K per channel over groups of
  ``k_group`` tokens, V per token over groups of ``v_group`` channels; fp16
  scale and zero point per group (:mod:`lynx_decode.codec.quant`).
- LYNX cuts every 8-bit code ``q`` into planes (the config's plane table, e.g.
  ``4,4`` or ``2,2,4``): plane ``i`` is ``(q >> shift_i) & (2**bits_i - 1)``,
  bit-packed densely (:mod:`lynx_decode.codec.pack`). Plane 0's buffer (the
  anchor) carries the packed top bits of K and V and all scales/zeros; each
  further plane's buffer its packed bit slice of K and V.
- Decoding a prefix of the planes (decode side only, no extra bytes) rebuilds
  interior bins at the centre of the missing bits and, on the default
  ``Split.MSB`` grid, each group's bottom and top bins by their occupancy
  (*occ-mean*, :mod:`lynx_decode.codec.quant`); all planes give exactly the INT8
  codes, and a dequantized tensor bitwise equal to the INT8 scheme's with the
  same config.
- Baselines share the API: BF16/FP16 passthrough, INT8, and INT4 quantized
  directly at 4 bits (same grouping). Each is one plane.

Where regions sit is described by :class:`LayerLayout` (:mod:`lynx_decode.codec.layout`).

Choice of split. ``Split.MSB`` (the default) keeps the plain full-range INT8
grid, so all planes decode to exactly the INT8 scheme's codes; ``Split.ROUNDED``
(QuantSpec-style, a stretched grid that also costs full-INT8 accuracy) stays
selectable for the speculative-decoding comparison. On the MSB grid interior
bins take the centre of the missing bits, code ``a * 2**r + (2**r - 1)/2``.

Reconstruction of the end bins: *occ-mean*. On the MSB grid every group's
extremes sit at codes 0 and 255, so a group's bottom (top) bin holding ``n`` of
its members holds its min (max) at the edge and ``n - 1`` others, and is rebuilt
at ``(edge + (n-1) * centre) / n`` (a lone extreme exactly, as INT8 has it).
Attention leans on the extremes, so this matters more to drafting than to the
relative error. The 8-bit codes and the full decode are unchanged, and no bytes
are added. ROUNDED keeps its own anchor-only rule (the rounded b-bit level) and
the centre for longer prefixes: its grid puts the extremes inside the end bins,
not on their outer edges.

The measurements behind these choices (error per split and rule, drafting
quality per rule): docs/design.md, "Measured facts".
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lynx_decode.codec.backends import Ops, codes_of, select
from lynx_decode.codec.backends.base import padded
from lynx_decode.codec.config import Backend, CodecConfig, Scheme, int8_source
from lynx_decode.codec.inputs import as_byte_buffer, as_f32, as_output, as_tensor
from lynx_decode.codec.layout import DType, LayerLayout, plane_region
from lynx_decode.errors import CodecError

__all__ = ["EncodedLayer", "encode_layer", "decode_layer", "int8_codes", "lynx_from_int8"]


@dataclass(frozen=True)
class EncodedLayer:
    """One encoded layer: a contiguous uint8 buffer per plane (keyed by plane index), and its layout."""

    layout: LayerLayout
    buffers: Mapping[int, Any]

    def wire_bytes(self, plane: int | None = None) -> int:
        """Bytes on ``plane`` (all planes when None)."""
        if plane is None:
            return sum(self.layout.plane_size(p) for p in range(self.layout.num_planes))
        return self.layout.plane_size(plane)


def _view(buf: Any, layout: LayerLayout, name: str, xp: Any) -> Any:
    r = layout.region(name)
    raw = buf[r.offset : r.offset + r.size]
    if r.dtype is DType.UINT8:
        return raw
    return raw.view(xp.uint16 if r.dtype is DType.BFLOAT16 else xp.float16).reshape(r.shape)


def encode_layer(k: Any, v: Any, config: CodecConfig = CodecConfig(), *, backend: Backend = Backend.AUTO,
                 planes: Iterable[int] | None = None) -> EncodedLayer:
    """Encode one layer's K and V (``[kv_heads, tokens, head_dim]``, fp32/fp16/bf16,
    NumPy/CuPy arrays or torch tensors). Buffers are of the inputs' array module,
    one per plane of ``config.plane_table`` (keyed 0, 1, ...).

    ``planes``: only these planes' buffers (default: all). A LYNX layer encoded a
    few planes at a time gives the same bytes as all at once, so a sender can put
    the anchors on the wire first and quantize again for the rest later; each
    pass costs about one full encode.

    Raises :class:`CodecError` for bad inputs (non-contiguous, unsupported dtype,
    mismatched shapes, non-finite values, a plane the scheme does not have) and
    :class:`BackendError` when the requested backend is unavailable.
    """
    if not isinstance(config, CodecConfig):
        raise CodecError(f"config must be a CodecConfig, got {type(config).__name__}")
    wanted = _wanted_planes(config, planes)
    tk, tv = as_tensor(k, "K"), as_tensor(v, "V")
    if tk.shape != tv.shape:
        raise CodecError(f"K and V shapes differ: {tk.shape} vs {tv.shape}")
    if tk.xp is not tv.xp:
        raise CodecError("K and V must both be host arrays or both be CuPy arrays")
    return _encode_with(select(backend, tk.xp), tk, tv, config, wanted)


def _wanted_planes(config: CodecConfig, planes: Iterable[int] | None) -> tuple[int, ...]:
    have = tuple(range(len(config.plane_table)))
    if planes is None:
        return have
    wanted = list(planes)
    bad = [p for p in wanted if isinstance(p, bool) or not isinstance(p, int) or p not in have]
    if bad or not wanted:
        raise CodecError(f"planes must be a non-empty subset of {list(have)} "
                         f"for {config.scheme.value} {','.join(map(str, config.planes))}, got {wanted!r}")
    return tuple(p for p in have if p in wanted)


def _new_buffers(layout: LayerLayout, xp: Any, planes: tuple[int, ...]) -> dict[int, Any]:
    # every region is written in full by the encoder: zero only the alignment gaps
    # (np.zeros would pay to clear, or to fault in, every page a second time)
    buffers = {p: xp.empty(layout.plane_size(p), dtype=xp.uint8) for p in planes}
    end = {p: 0 for p in planes}
    for r in layout.regions:
        if r.plane not in buffers:
            continue
        if r.offset > end[r.plane]:
            buffers[r.plane][end[r.plane] : r.offset] = 0
        end[r.plane] = r.offset + r.size
    return buffers


def _params(anchor: Any, layout: LayerLayout, name: str, xp: Any) -> tuple[Any, Any]:
    """(scale, zero) of ``name`` in the anchor buffer; without one (an encode of
    later planes only) scratch the encoder overwrites."""
    if anchor is not None:
        return _view(anchor, layout, f"{name}_scale", xp), _view(anchor, layout, f"{name}_zero", xp)
    r = layout.region(f"{name}_scale")
    return xp.empty(r.shape, xp.float16), xp.empty(r.shape, xp.float16)


def _encode_with(ops: Ops, tk: Any, tv: Any, config: CodecConfig,
                 planes: tuple[int, ...] | None = None) -> EncodedLayer:
    xp = ops.xp
    layout = LayerLayout.build(config, *tk.shape)
    planes = tuple(range(layout.num_planes)) if planes is None else planes
    buffers = _new_buffers(layout, xp, planes)
    anchor = buffers.get(0)
    for name, t in (("k", tk), ("v", tv)):
        if config.scheme is Scheme.BF16:
            if t.bf16:
                _view(anchor, layout, f"{name}_data", xp)[...] = t.data
            else:
                ops.to_bf16(as_f32(t), _view(anchor, layout, f"{name}_data", xp))
            continue
        x = as_f32(t)
        if config.scheme is Scheme.FP16:
            with np.errstate(over="ignore"):
                half = x.astype(xp.float16)
            if not bool((xp.isfinite(half) == xp.isfinite(x)).all()):
                raise CodecError(f"{name.upper()} has values outside the fp16 range (|x| > 65504); use Scheme.BF16")
            _view(anchor, layout, f"{name}_data", xp)[...] = half
            continue
        outs = [None if p not in buffers else _view(buffers[p], layout, plane_region(name, p), xp)
                for p in range(layout.num_planes)]
        scale, zero = _params(anchor, layout, name, xp)
        ops.encode(x, name, config, scale, zero, outs)
    return EncodedLayer(layout, types.MappingProxyType(buffers))


def lynx_from_int8(layer: EncodedLayer, config: CodecConfig, *, planes: Iterable[int] | None = None,
                   backend: Backend = Backend.AUTO) -> EncodedLayer:
    """The LYNX layer ``config`` (``planes``: only these planes' buffers, default all) cut from an
    INT8 layer encoded with :func:`~lynx_decode.codec.config.int8_source` of ``config``: its codes
    split into bit planes and packed, its scales copied into plane 0. The bytes equal
    :func:`encode_layer`'s for ``config`` on the same K and V; no quantization runs (a bit slice
    and a pack per plane), so a prefill node holds one INT8 cache and cuts any split from it as a
    pull asks. :class:`CodecError` when ``config`` cannot be cut from this layer."""
    source = int8_source(config) if isinstance(config, CodecConfig) else None
    if source is None:
        raise CodecError(f"only a LYNX split on the MSB grid is cut from INT8 codes, not {config!r}")
    src = layer.layout
    if (src.scheme, src.k_group, src.v_group, src.split) != (Scheme.INT8, source.k_group, source.v_group,
                                                             source.split):
        raise CodecError(f"a {src.scheme.value} layer (groups {src.k_group}/{src.v_group}) is not the INT8 "
                         f"form {config} is cut from (groups {config.k_group}/{config.v_group})")
    wanted = _wanted_planes(config, planes)
    ops, (data,) = _inputs(src, (layer.buffers[0],), backend)
    xp = ops.xp
    layout = LayerLayout.build(config, *src.shape)
    buffers = _new_buffers(layout, xp, wanted)
    n = src.kv_heads * src.tokens * src.head_dim
    for name in ("k", "v"):
        codes = _view(data, src, f"{name}_data", xp)
        if padded(n) != n:  # the packing kernels take whole 64-value blocks
            codes = xp.concatenate([codes, xp.zeros(padded(n) - n, dtype=xp.uint8)])
        ops.cut_planes(codes, config, [_view(buffers[p], layout, plane_region(name, p), xp) if p in buffers
                                       else None for p in range(layout.num_planes)])
        if 0 in buffers:
            for part in ("scale", "zero"):
                _view(buffers[0], layout, f"{name}_{part}", xp)[...] = _view(data, src, f"{name}_{part}", xp)
    return EncodedLayer(layout, types.MappingProxyType(buffers))


def _inputs(layout: Any, buffers: Sequence[Any], backend: Backend) -> tuple[Ops, list[Any]]:
    if not isinstance(layout, LayerLayout):
        raise CodecError(f"layout must be a LayerLayout, got {type(layout).__name__}")
    layout.validate()
    nones = [i for i, b in enumerate(buffers) if b is None]
    if nones:  # decode_layer(layout, anchor, None): the planes before the first None
        cut = nones[0]
        if cut == 0 or any(b is not None for b in buffers[cut:]):
            raise CodecError("plane buffers must be a prefix starting with plane 0: no None before a buffer")
        buffers = buffers[:cut]
    if not 1 <= len(buffers) <= layout.num_planes:
        raise CodecError(f"a {layout.scheme.value} layer has {layout.num_planes} plane(s); "
                         f"got {len(buffers)} buffers (pass the first 1..{layout.num_planes}, in order)")
    xp = np if type(buffers[0]).__module__.split(".")[0] != "cupy" else select(Backend.CUPY, _cupy_module()).xp
    ops = select(backend, xp)
    return ops, [as_byte_buffer(b, f"plane {p} buffer", layout.plane_size(p), xp) for p, b in enumerate(buffers)]


def _cupy_module() -> Any:
    import cupy  # noqa: PLC0415 - only reached with a CuPy buffer in hand

    return cupy


def _plane_views(ops: Ops, layout: LayerLayout, bufs: list[Any], name: str) -> list[Any]:
    return [_view(b, layout, plane_region(name, p), ops.xp) for p, b in enumerate(bufs)]


def decode_layer(
    layout: LayerLayout,
    anchor: Any,
    *planes: Any,
    out_k: Any = None,
    out_v: Any = None,
    dtype: Any = None,
    backend: Backend = Backend.AUTO,
) -> tuple[Any, Any]:
    """Decode one layer to (K, V) ``[kv_heads, tokens, head_dim]``.

    ``anchor`` (plane 0) and ``planes`` (planes 1, 2, ... in order, any prefix)
    are the layer's plane buffers: uint8 NumPy/CuPy arrays or bytes-like objects,
    at least ``layout.plane_size`` long. With fewer than all planes a LYNX layer
    is reconstructed from its top bits; with all, exactly as the INT8 scheme.
    Results are written into ``out_k``/``out_v`` when given (fp32/fp16 arrays or
    torch tensors of the right shape, filled in place and returned); otherwise
    new arrays of ``dtype`` (float32 by default, or float16).
    """
    ops, bufs = _inputs(layout, (anchor, *planes), backend)
    return _decode_with(ops, layout, bufs, out_k, out_v, dtype)


def _decode_with(ops: Ops, layout: LayerLayout, bufs: list[Any], out_k: Any, out_v: Any,
                 dtype: Any) -> tuple[Any, Any]:
    xp = ops.xp
    results = []
    for name, out in (("k", out_k), ("v", out_v)):
        if out is None:
            want = np.dtype(np.float32 if dtype is None else dtype)
            if want not in (np.float32, np.float16):
                raise CodecError(f"dtype must be float32 or float16, got {want}")
            out = xp.empty(layout.shape, dtype=want)
        else:
            out = as_output(out, f"out_{name}", layout.shape, xp)
            if dtype is not None and np.dtype(dtype) != out.dtype:
                raise CodecError(f"dtype={np.dtype(dtype)} disagrees with out_{name}.dtype={out.dtype}")
        target = out if out.dtype == np.float32 else xp.empty(layout.shape, dtype=xp.float32)
        _decode_one(ops, layout, bufs, name, target)
        if target is not out:
            out[...] = target.astype(out.dtype)
        results.append(out)
    return results[0], results[1]


def _decode_one(ops: Ops, layout: LayerLayout, bufs: list[Any], name: str, out: Any) -> None:
    xp = ops.xp
    if layout.scheme is Scheme.BF16:
        ops.from_bf16(_view(bufs[0], layout, f"{name}_data", xp), out)
        return
    if layout.scheme is Scheme.FP16:
        out[...] = _view(bufs[0], layout, f"{name}_data", xp)
        return
    scale, zero = (_view(bufs[0], layout, f"{name}_{p}", xp) for p in ("scale", "zero"))
    ops.decode(layout, name, _plane_views(ops, layout, bufs, name), scale, zero, out)


def int8_codes(layout: LayerLayout, anchor: Any, *planes: Any, backend: Backend = Backend.AUTO) -> tuple[Any, Any]:
    """The 8-bit codes (K, V) ``[kv_heads, tokens, head_dim]`` uint8 of an INT8 layer
    (its one plane) or a LYNX layer (all its planes, exactly)."""
    if isinstance(layout, LayerLayout) and layout.scheme not in (Scheme.INT8, Scheme.LYNX):
        raise CodecError(f"a {layout.scheme.value} layer has no 8-bit codes")
    if isinstance(layout, LayerLayout) and 1 + len(planes) != layout.num_planes:
        raise CodecError(f"the 8-bit codes of a {layout.scheme.value} layer need all "
                         f"{layout.num_planes} plane buffers, got {1 + len(planes)}")
    ops, bufs = _inputs(layout, (anchor, *planes), backend)
    out = []
    for name in ("k", "v"):
        values, _shift = codes_of(ops, layout, _plane_views(ops, layout, bufs, name))
        out.append(values.copy())
    return out[0], out[1]
