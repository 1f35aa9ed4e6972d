"""The hierarchical KV codec: encode a layer's K and V into stream buffers, and
decode them from the anchor stream alone or from anchor + residual.

Format (per layer, ``[kv_heads, tokens, head_dim]`` K and V):

- Asymmetric uniform INT8, KIVI grouping: K per channel over groups of
  ``k_group`` tokens, V per token over groups of ``v_group`` channels; fp16
  scale and zero point per group (:mod:`lynx_decode.codec_quant`).
- LYNX splits every 8-bit code ``q`` into the anchor ``q >> r`` (top ``b`` bits,
  ``r = 8 - b``) and the residual ``q & (2**r - 1)``, each bit-packed densely
  (:mod:`lynx_decode.codec_pack`). The anchor buffer carries the packed K and V
  anchors and all scales/zeros; the residual buffer the packed residuals.
- Anchor-only decoding reconstructs the centre of the missing bits; anchor +
  residual gives exactly the INT8 codes, and a dequantized tensor bitwise equal to
  the INT8 scheme's with the same config.
- Baselines share the API: BF16/FP16 passthrough, INT8, and INT4 quantized
  directly at 4 bits (same grouping). Each puts one buffer on the anchor stream.

Where regions sit is described by :class:`LayerLayout` (:mod:`lynx_decode.codec_layout`).

Choice of split. Anchor-only relative error ``||x - x_hat|| / ||x||``, mean over
the 30 layers of SmolLM2-135M-Instruct on a 2048-token English prompt (fp32, K
after RoPE, groups 64/64). Command:
``pytest -m "bench and model" tests/bench/test_codec_bench.py -s -p no:randomly``::

    b  split              anchor K   anchor V   anchor+residual (= INT8) K / V
    2  MSB (centre)       17.21 %    40.34 %    0.259 % / 0.605 %
    2  ROUNDED            22.25 %    51.37 %    0.343 % / 0.802 %
    3  MSB (centre)        8.62 %    20.15 %    0.259 % / 0.605 %
    3  ROUNDED             9.42 %    22.05 %    0.294 % / 0.687 %
    4  MSB (centre)        4.29 %    10.05 %    0.259 % / 0.605 %
    4  MSB (1 << (r-1))    4.32 %    10.11 %
    4  ROUNDED             4.41 %    10.32 %    0.274 % / 0.642 %
    5  MSB (centre)        2.14 %     5.00 %    0.259 % / 0.605 %
    5  ROUNDED             2.17 %     5.08 %    0.266 % / 0.621 %
    6  MSB (centre)        1.06 %     2.47 %    0.259 % / 0.605 %
    6  MSB (1 << (r-1))    1.15 %     2.69 %
    6  ROUNDED             1.14 %     2.66 %    0.261 % / 0.611 %

MSB with centre reconstruction (code ``a * 2**r + (2**r - 1)/2``, slightly better
than the integer midpoint ``(a << r) | (1 << (r-1))``) wins at every b, and keeps
the plain full-range INT8 grid (ROUNDED's stretched grid also costs full-INT8
accuracy), so it is the default; ``Split.ROUNDED`` (QuantSpec-style) stays
selectable for the speculative-decoding comparison.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lynx_decode.codec_backends import Ops, codes_of, select
from lynx_decode.codec_config import Backend, CodecConfig, Scheme, Stream
from lynx_decode.codec_inputs import as_byte_buffer, as_f32, as_output, as_tensor
from lynx_decode.codec_layout import DType, LayerLayout
from lynx_decode.errors import CodecError

__all__ = ["EncodedLayer", "encode_layer", "decode_layer", "int8_codes"]


@dataclass(frozen=True)
class EncodedLayer:
    """One encoded layer: a contiguous uint8 buffer per stream, and its layout."""

    layout: LayerLayout
    buffers: Mapping[Stream, Any]

    def wire_bytes(self, stream: Stream | None = None) -> int:
        """Bytes on ``stream`` (all streams when None)."""
        if stream is None:
            return sum(self.layout.stream_size(s) for s in self.layout.streams)
        return self.layout.stream_size(stream)


def _view(buf: Any, layout: LayerLayout, name: str, xp: Any) -> Any:
    r = layout.region(name)
    raw = buf[r.offset : r.offset + r.size]
    if r.dtype is DType.UINT8:
        return raw
    return raw.view(xp.uint16 if r.dtype is DType.BFLOAT16 else xp.float16).reshape(r.shape)


def encode_layer(k: Any, v: Any, config: CodecConfig = CodecConfig(), *, backend: Backend = Backend.AUTO,
                 streams: Iterable[Stream] | None = None) -> EncodedLayer:
    """Encode one layer's K and V (``[kv_heads, tokens, head_dim]``, fp32/fp16/bf16,
    NumPy/CuPy arrays or torch tensors). Buffers are of the inputs' array module.

    ``streams``: only these streams' buffers (default: all of the scheme's). A LYNX
    layer encoded one stream at a time gives the same bytes as both at once, so a
    sender can put the anchors on the wire first and quantize again for the
    residual later; each pass costs about one full encode.

    Raises :class:`CodecError` for bad inputs (non-contiguous, unsupported dtype,
    mismatched shapes, non-finite values, a stream the scheme does not have) and
    :class:`BackendError` when the requested backend is unavailable.
    """
    if not isinstance(config, CodecConfig):
        raise CodecError(f"config must be a CodecConfig, got {type(config).__name__}")
    wanted = _wanted_streams(config, streams)
    tk, tv = as_tensor(k, "K"), as_tensor(v, "V")
    if tk.shape != tv.shape:
        raise CodecError(f"K and V shapes differ: {tk.shape} vs {tv.shape}")
    if tk.xp is not tv.xp:
        raise CodecError("K and V must both be host arrays or both be CuPy arrays")
    return _encode_with(select(backend, tk.xp), tk, tv, config, wanted)


def _wanted_streams(config: CodecConfig, streams: Iterable[Stream] | None) -> tuple[Stream, ...]:
    have = (Stream.ANCHOR, Stream.RESIDUAL) if config.scheme is Scheme.LYNX else (Stream.ANCHOR,)
    if streams is None:
        return have
    wanted = set(streams)
    bad = [s for s in wanted if not isinstance(s, Stream) or s not in have]
    if bad or not wanted:
        raise CodecError(f"streams must be a non-empty subset of {[s.value for s in have]} "
                         f"for {config.scheme.value}, got {list(streams)!r}")
    return tuple(s for s in have if s in wanted)


def _new_buffers(layout: LayerLayout, xp: Any, streams: tuple[Stream, ...]) -> dict[Stream, Any]:
    # every region is written in full by the encoder: zero only the alignment gaps
    # (np.zeros would pay to clear, or to fault in, every page a second time)
    buffers = {s: xp.empty(layout.stream_size(s), dtype=xp.uint8) for s in streams}
    end = {s: 0 for s in streams}
    for r in layout.regions:
        if r.stream not in buffers:
            continue
        if r.offset > end[r.stream]:
            buffers[r.stream][end[r.stream] : r.offset] = 0
        end[r.stream] = r.offset + r.size
    return buffers


def _anchor_regions(anchor: Any, layout: LayerLayout, name: str, xp: Any) -> tuple[Any, Any, Any]:
    """(scale, zero, data) of ``name`` in the anchor buffer; without one (a residual-only
    encode) scratch scale/zero the encoder overwrites, and no data."""
    if anchor is not None:
        return tuple(_view(anchor, layout, f"{name}_{p}", xp) for p in ("scale", "zero", "data"))
    r = layout.region(f"{name}_scale")
    return xp.empty(r.shape, xp.float16), xp.empty(r.shape, xp.float16), None


def _encode_with(ops: Ops, tk: Any, tv: Any, config: CodecConfig,
                 streams: tuple[Stream, ...] = (Stream.ANCHOR, Stream.RESIDUAL)) -> EncodedLayer:
    xp = ops.xp
    layout = LayerLayout.build(config, *tk.shape)
    streams = tuple(s for s in streams if s in layout.streams)
    buffers = _new_buffers(layout, xp, streams)
    anchor = buffers.get(Stream.ANCHOR)
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
        residual = None
        if Stream.RESIDUAL in buffers:
            residual = _view(buffers[Stream.RESIDUAL], layout, f"{name}_residual", xp)
        scale, zero, data = _anchor_regions(anchor, layout, name, xp)
        ops.encode(x, name, config, scale, zero, data, residual)
    return EncodedLayer(layout, types.MappingProxyType(buffers))


def _inputs(layout: Any, anchor: Any, residual: Any, backend: Backend) -> tuple[Ops, Any, Any]:
    if not isinstance(layout, LayerLayout):
        raise CodecError(f"layout must be a LayerLayout, got {type(layout).__name__}")
    layout.validate()
    xp = np if type(anchor).__module__.split(".")[0] != "cupy" else select(Backend.CUPY, _cupy_module()).xp
    ops = select(backend, xp)
    a = as_byte_buffer(anchor, "anchor buffer", layout.stream_size(Stream.ANCHOR), xp)
    r = None
    if residual is not None:
        if layout.scheme is not Scheme.LYNX:
            raise CodecError(f"a {layout.scheme.value} layer has no residual stream; pass residual=None")
        r = as_byte_buffer(residual, "residual buffer", layout.stream_size(Stream.RESIDUAL), xp)
    return ops, a, r


def _cupy_module() -> Any:
    import cupy  # noqa: PLC0415 - only reached with a CuPy buffer in hand

    return cupy


def _codes(ops: Ops, layout: LayerLayout, a: Any, r: Any, name: str) -> tuple[Any, int, float]:
    """(values [H,T,D] uint8, shift, offset) such that code = values * 2**shift + offset."""
    xp = ops.xp
    residual = None if r is None else _view(r, layout, f"{name}_residual", xp)
    return codes_of(ops, layout, _view(a, layout, f"{name}_data", xp), residual)


def decode_layer(
    layout: LayerLayout,
    anchor: Any,
    residual: Any = None,
    *,
    out_k: Any = None,
    out_v: Any = None,
    dtype: Any = None,
    backend: Backend = Backend.AUTO,
) -> tuple[Any, Any]:
    """Decode one layer to (K, V) ``[kv_heads, tokens, head_dim]``.

    ``anchor`` (and ``residual``) are the layer's stream buffers: uint8 NumPy/CuPy
    arrays or bytes-like objects, at least ``layout.stream_size`` long. With
    ``residual=None`` a LYNX layer is reconstructed from its anchors alone; with it,
    exactly as the INT8 scheme. Results are written into ``out_k``/``out_v`` when
    given (fp32/fp16 arrays or torch tensors of the right shape, filled in place and
    returned); otherwise new arrays of ``dtype`` (float32 by default, or float16).
    """
    ops, a, r = _inputs(layout, anchor, residual, backend)
    return _decode_with(ops, layout, a, r, out_k, out_v, dtype)


def _decode_with(ops: Ops, layout: LayerLayout, a: Any, r: Any, out_k: Any, out_v: Any, dtype: Any) -> tuple[Any, Any]:
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
        _decode_one(ops, layout, a, r, name, target)
        if target is not out:
            out[...] = target.astype(out.dtype)
        results.append(out)
    return results[0], results[1]


def _decode_one(ops: Ops, layout: LayerLayout, a: Any, r: Any, name: str, out: Any) -> None:
    xp = ops.xp
    if layout.scheme is Scheme.BF16:
        ops.from_bf16(_view(a, layout, f"{name}_data", xp), out)
        return
    if layout.scheme is Scheme.FP16:
        out[...] = _view(a, layout, f"{name}_data", xp)
        return
    residual = None if r is None else _view(r, layout, f"{name}_residual", xp)
    scale, zero = (_view(a, layout, f"{name}_{p}", xp) for p in ("scale", "zero"))
    ops.decode(layout, name, _view(a, layout, f"{name}_data", xp), residual, scale, zero, out)


def int8_codes(
    layout: LayerLayout, anchor: Any, residual: Any = None, *, backend: Backend = Backend.AUTO
) -> tuple[Any, Any]:
    """The 8-bit codes (K, V) ``[kv_heads, tokens, head_dim]`` uint8 of an INT8 layer
    (anchor only) or a LYNX layer (anchor + residual, exactly)."""
    if isinstance(layout, LayerLayout) and layout.scheme not in (Scheme.INT8, Scheme.LYNX):
        raise CodecError(f"a {layout.scheme.value} layer has no 8-bit codes")
    if isinstance(layout, LayerLayout) and layout.scheme is Scheme.LYNX and residual is None:
        raise CodecError("the 8-bit codes of a LYNX layer need the residual buffer")
    ops, a, r = _inputs(layout, anchor, residual, backend)
    out = []
    for name in ("k", "v"):
        values, _shift, _offset = _codes(ops, layout, a, r, name)
        out.append(values.copy())
    return out[0], out[1]
