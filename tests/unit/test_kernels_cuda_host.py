"""The CUDA source's kernel bodies, compiled for the *host* by nvcc and driven
through the CuPy backend's own launch code, produce the NumPy reference's bytes.

There is no GPU on most CI machines; this checks everything in ``codec.cu`` but
the launch itself (bit packing, parameter indexing, rounding) and the argument
order of :class:`lynx_decode.codec.backends.CupyOps`. The real-device comparison is
``tests/integration/test_codec_gpu.py`` (marked ``gpu``).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from lynx_decode.codec.api import _decode_with, _encode_with
from lynx_decode.codec.backends import CupyOps, ReferenceOps
from lynx_decode.codec.config import Scheme
from lynx_decode.codec.inputs import as_byte_buffer, as_tensor
from lynx_kernels import cuda
from tests.unit._codec_cases import cases

# one host entry point per kernel: loop the kernel body over every thread index
_KERNELS = {
    "lynx_split": ("const u64 *a0, u64 *a1, u64 *a2, long long a3, int a4", "a0, a1, a2, a3, a4"),
    "lynx_merge": ("const u64 *a0, const u64 *a1, u64 *a2, long long a3, int a4", "a0, a1, a2, a3, a4"),
    "lynx_pack": ("const u64 *a0, u64 *a1, long long a2, int a3", "a0, a1, a2, a3"),
    "lynx_unpack": ("const u64 *a0, u64 *a1, long long a2, int a3", "a0, a1, a2, a3"),
    "lynx_quantize": (
        "const float *a0, const float *a1, const float *a2, u8 *a3, int a4, int a5, int a6, int a7, int a8, float a9, "
        "long long a10",
        "a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10",
    ),
    "lynx_dequant": (
        "const u8 *a0, float a1, float a2, const float *a3, const float *a4, float *a5, int a6, int a7, int a8, "
        "int a9, int a10, long long a11",
        "a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11",
    ),
    "lynx_end_codes": (
        "const u8 *a0, float *a1, float *a2, int a3, int a4, int a5, int a6, int a7, int a8, long long a9",
        "a0, a1, a2, a3, a4, a5, a6, a7, a8, a9",
    ),
    "lynx_dequant_ends": (
        "const u8 *a0, float a1, float a2, int a3, const float *a4, const float *a5, const float *a6, "
        "const float *a7, float *a8, int a9, int a10, int a11, int a12, int a13, long long a14",
        "a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14",
    ),
}


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.fail("nvcc is required to check the CUDA sources (see `make check-kernels`)")
    tmp = tmp_path_factory.mktemp("cuda_host")
    src = [f'#include "{cuda.SOURCE}"']
    for name, (params, args) in _KERNELS.items():
        src.append(f'extern "C" void host_{name}(long long threads, {params}) {{')
        src.append(f"    for (long long t = 0; t < threads; ++t) {name}_at(t, {args});")
        src.append("}")
    (tmp / "host.cu").write_text("\n".join(src) + "\n")
    cmd = [nvcc, "-std=c++17", "-O1", "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off",
           "-o", str(tmp / "host.so"), str(tmp / "host.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stderr}"
    return ctypes.CDLL(str(tmp / "host.so"))


class HostCudaOps(CupyOps):
    """CupyOps with its launches run on the host by the compiled kernel bodies."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ReferenceOps.__init__(self, np)
        self._lib = lib

    def _launch(self, name: str, items: int, *args) -> None:
        conv = []
        for a in args:
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous
                conv.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.int64):
                conv.append(ctypes.c_longlong(int(a)))
            elif isinstance(a, np.int32):
                conv.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.float32):
                conv.append(ctypes.c_float(float(a)))
            else:
                raise AssertionError(f"untyped kernel argument {a!r}: CuPy needs NumPy scalar types")
        getattr(self._lib, f"host_{name}")(ctypes.c_longlong(items), *conv)


@given(case=cases(schemes=tuple(Scheme), max_tokens=80))
@settings(max_examples=40, deadline=None)
def test_cuda_kernel_bodies_match_reference(host_lib, case) -> None:
    ops = HostCudaOps(host_lib)
    ref_ops = ReferenceOps()
    k, v = case.inputs()
    tk, tv = as_tensor(k, "K"), as_tensor(v, "V")
    ref = _encode_with(ref_ops, tk, tv, case.config)
    got = _encode_with(ops, tk, tv, case.config)
    for stream in range(ref.layout.num_planes):
        np.testing.assert_array_equal(got.buffers[stream], ref.buffers[stream])
    for n in range(1, ref.layout.num_planes + 1):  # every prefix of the planes
        bufs = [ref.buffers[p] for p in range(n)]
        want = _decode_with(ref_ops, ref.layout, bufs, None, None, None)
        have = _decode_with(ops, ref.layout, bufs, None, None, None)
        for g, w in zip(have, want):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_kernel_source_ships_with_the_package() -> None:
    assert cuda.SOURCE.name == "codec.cu" and cuda.SOURCE.is_file()
    assert Path(cuda.SOURCE).read_text().count('extern "C" __global__') == len(_KERNELS)
    assert as_byte_buffer(b"\x00" * 8, "x", 8, np).size == 8
