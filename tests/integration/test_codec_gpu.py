"""On a CUDA device, the CuPy backend (kernels from ``kernels/codec.cu``) produces
the NumPy reference's bytes exactly: every stream buffer and every decoded output.

Marked ``gpu``: skipped by the capability probe in ``tests/conftest.py`` when CuPy
or a device is missing. ``tests/unit/test_kernels_cuda_host.py`` runs the same
kernel bodies on the host everywhere.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lynx_decode import Backend, CodecConfig, Scheme, Split, decode_layer, encode_layer
from lynx_decode.codec import int8_codes, lynx_from_int8
from lynx_decode.codec.config import int8_source
from lynx_transport.errors import BackendError

pytestmark = pytest.mark.gpu

SHAPES = [(3, 2014, 64), (1, 1, 1), (2, 77, 33), (3, 64, 64)]
CONFIGS = [
    CodecConfig(scheme=s, bits=b, split=sp, k_group=kg, v_group=vg)
    for s, b, sp, (kg, vg) in itertools.chain(
        itertools.product([Scheme.LYNX], [2, 3, 4, 5, 6], list(Split), [(64, 64), (7, 16)]),
        itertools.product([Scheme.INT8, Scheme.INT4, Scheme.BF16, Scheme.FP16], [4], [Split.MSB], [(64, 64), (5, 128)]),
    )
]


def _layer(shape, seed: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal(shape) * rng.choice([0.1, 1.0, 20.0], size=(1, 1, shape[2]))).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    return k, v


def _same(a, b) -> None:
    import cupy

    a = cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"{c.scheme.value}-b{c.bits}-{c.split.value}-g{c.k_group}x{c.v_group}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cupy_matches_reference_byte_for_byte(config: CodecConfig, shape, dtype) -> None:
    import cupy

    k, v = _layer(shape, hash((shape, config.bits)) % 2**32, dtype)
    ref = encode_layer(k, v, config, backend=Backend.NUMPY)
    gpu = encode_layer(cupy.asarray(k), cupy.asarray(v), config)  # AUTO -> CuPy for device arrays
    assert gpu.layout == ref.layout
    for stream in range(ref.layout.num_planes):
        assert isinstance(gpu.buffers[stream], cupy.ndarray)
        _same(gpu.buffers[stream], ref.buffers[stream])
        if config.scheme is Scheme.LYNX:  # one stream at a time: the same bytes
            one = encode_layer(cupy.asarray(k), cupy.asarray(v), config, planes=[stream])
            _same(one.buffers[stream], ref.buffers[stream])
    a = ref.buffers[0]
    residual = ref.buffers.get(1)
    for res in [None] if residual is None else [None, residual]:
        for out_dtype in (np.float32, np.float16):
            want = decode_layer(ref.layout, a, res, dtype=out_dtype, backend=Backend.NUMPY)
            on_gpu = None if res is None else cupy.asarray(res)
            got = decode_layer(ref.layout, cupy.asarray(a), on_gpu, dtype=out_dtype, backend=Backend.CUPY)
            for g, w in zip(got, want):
                _same(g, w)
    if config.scheme in (Scheme.INT8, Scheme.LYNX):
        d_res = None if residual is None else cupy.asarray(residual)
        want_codes = int8_codes(ref.layout, a, residual, backend=Backend.NUMPY)
        for g, w in zip(int8_codes(ref.layout, cupy.asarray(a), d_res), want_codes):
            _same(g, w)


def test_cupy_decodes_into_device_out_arrays() -> None:
    import cupy

    k, v = _layer((3, 300, 64), 1, np.float32)
    enc = encode_layer(cupy.asarray(k), cupy.asarray(v))
    out_k = cupy.empty((3, 300, 64), cupy.float32)
    out_v = cupy.empty((3, 300, 64), cupy.float32)
    a, r = enc.buffers[0], enc.buffers[1]
    got_k, got_v = decode_layer(enc.layout, a, r, out_k=out_k, out_v=out_v)
    assert got_k is out_k and got_v is out_v
    want_k, _ = decode_layer(enc.layout, cupy.asnumpy(a), cupy.asnumpy(r), backend=Backend.NUMPY)
    _same(out_k, want_k)


def test_kernels_are_compiled_once_per_device() -> None:
    from lynx_kernels import cuda

    assert cuda.module() is cuda.module()


def test_host_backends_refuse_device_arrays() -> None:
    import cupy

    k = cupy.zeros((1, 4, 8), cupy.float32)
    with pytest.raises(BackendError, match="host arrays"):
        encode_layer(k, k, backend=Backend.NUMBA)


@pytest.mark.parametrize("planes", [(2, 2, 4), (3, 1, 4), (4, 2, 2)], ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("split", list(Split), ids=lambda s: s.value)
@pytest.mark.parametrize("shape", [(3, 2014, 64), (2, 77, 33)], ids=lambda s: "x".join(map(str, s)))
def test_cupy_every_prefix_of_a_multi_plane_split(planes, split: Split, shape) -> None:
    # every prefix of the planes, occ-mean end bins (MSB) included: the reference's bytes
    import cupy

    k, v = _layer(shape, 11, np.float32)
    config = CodecConfig(planes=planes, split=split, k_group=64, v_group=16)
    ref = encode_layer(k, v, config, backend=Backend.NUMPY)
    bufs = [ref.buffers[p] for p in range(ref.layout.num_planes)]
    for n in range(1, len(bufs) + 1):
        want = decode_layer(ref.layout, *bufs[:n], backend=Backend.NUMPY)
        got = decode_layer(ref.layout, *(cupy.asarray(b) for b in bufs[:n]), backend=Backend.CUPY)
        for g, w in zip(got, want):
            _same(g, w)


@pytest.mark.parametrize("planes", [(4, 4), (3, 5), (2, 2, 4)])
@pytest.mark.parametrize("shape", [(3, 2014, 64), (2, 77, 33)], ids=lambda s: "x".join(map(str, s)))
def test_cupy_cuts_a_split_from_int8_codes_as_the_reference_encodes_it(planes, shape) -> None:
    """What a prefill node holding INT8 on the device sends for a split: the split's own bytes."""
    import cupy

    config = CodecConfig(Scheme.LYNX, planes=planes)
    k, v = _layer(shape, 11, np.float32)
    ref = encode_layer(k, v, config, backend=Backend.NUMPY)
    int8 = encode_layer(cupy.asarray(k), cupy.asarray(v), int8_source(config))
    cut = lynx_from_int8(int8, config)
    assert cut.layout == ref.layout
    for plane in range(ref.layout.num_planes):
        assert isinstance(cut.buffers[plane], cupy.ndarray)
        _same(cut.buffers[plane], ref.buffers[plane])
        _same(lynx_from_int8(int8, config, planes=[plane]).buffers[plane], ref.buffers[plane])
