"""lynx_kernels (installed from the repository's ``kernels/`` folder): device code
for the codec. CUDA sources (``*.cu``) for CuPy, compiled lazily and cached per
device, and their Numba CPU twins. Imported by lynx_decode; imports nothing above
lynx_transport."""

__all__: list[str] = []
