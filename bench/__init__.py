"""lynx_bench (installed from the repository's ``bench/`` folder): the ``lynx``
command line, the bandwidth sweep tool and link emulation. The top layer: it uses
lynx_transport, lynx_kernels and lynx_decode."""

__all__: list[str] = []
