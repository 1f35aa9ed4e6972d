"""The one adapter between Lynx and ucxx.

Everything UCX goes through here: ucxx is imported lazily (importing it writes
``UCX_*`` environment variables, so it must never happen at ``lynx_transport``
import), the context is configured through ``config_dict`` (never the
environment), and ucxx exceptions are translated into :mod:`lynx_transport.errors`
in :func:`check`.

We use ucxx's low-level API (``ucxx._lib.libucxx``): one worker per I/O thread,
progressed by that thread (polling while requests are pending, blocking on the
worker's epoll fd when idle). Endpoints are created from the receiver's worker
address (exchanged on the control channel) without peer-error handling, which
keeps UCX's shared-memory transports available; peer loss is detected by the
control channel instead.
"""

from __future__ import annotations

from typing import Any

from lynx_transport.errors import (ConnectError, PeerDisconnectedError, ProtocolError,
                                   TransportError)

__all__ = ["UcxWorker", "check", "as_bytes_view", "ensure_cuda_context"]


def _lib() -> Any:
    import ucxx._lib.libucxx as libucxx  # noqa: PLC0415 - lazy: writes UCX_* env vars

    return libucxx


def _array(view: Any) -> Any:
    from ucxx._lib.arr import Array  # noqa: PLC0415

    return Array(view)


class UcxWorker:
    """A UCX context + worker in blocking-progress mode, owned by one thread."""

    def __init__(self, tls: str, net_devices: str = "all") -> None:
        lib = _lib()
        try:
            self._ctx = lib.UCXContext(config_dict={"TLS": tls, "NET_DEVICES": net_devices},
                                       feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
            self._worker = lib.UCXWorker(self._ctx)
            self._worker.init_blocking_progress_mode()
        except Exception as exc:
            raise TransportError(f"cannot start UCX (UCX_TLS={tls!r}, "
                                 f"UCX_NET_DEVICES={net_devices!r}): {exc}") from exc
        self._lib = lib

    @property
    def address(self) -> bytes:
        """This worker's UCX address (what a peer needs to reach it)."""
        return bytes(self._worker.address)

    @property
    def epoll_fd(self) -> int:
        return int(self._worker.epoll_file_descriptor)

    def progress(self) -> None:
        self._worker.progress()

    def arm(self) -> bool:
        """True when it is safe to sleep on :attr:`epoll_fd`."""
        return bool(self._worker.arm())

    def tag_recv(self, view: Any, tag: int) -> Any:
        """Post a receive of exactly ``view.nbytes`` bytes for ``tag`` into ``view``."""
        return self._worker.tag_recv(_array(view), self._lib.UCXXTag(tag))

    def endpoint(self, address: bytes) -> Any:
        """An endpoint to the worker at ``address`` (from the peer's WELCOME).

        UCX asserts (aborting the process) on an address of the wrong format
        version, so that much is checked here against this worker's own
        address. UCX does not validate the rest; only connect to receivers you
        trust (the shared-secret handshake of issue 6 belongs before this).
        """
        own = self.address
        if not address or (address[0] & 0x0F) != (own[0] & 0x0F):
            raise ConnectError("the receiver's UCX worker address is malformed "
                               "(wrong UCX address version)")
        try:
            addr = self._lib.UCXAddress.create_from_buffer(address)
            return self._worker.create_endpoint_from_worker_address(addr, False)
        except Exception as exc:
            raise ConnectError(f"cannot reach the receiver's UCX worker: {exc}") from exc

    def tag_send(self, endpoint: Any, view: Any, tag: int) -> Any:
        return endpoint.tag_send(_array(view), self._lib.UCXXTag(tag))

    def close(self) -> None:
        """Release the worker and context (on the owning thread, after its requests)."""
        if self._worker is not None:
            try:
                self._worker.progress()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass
        self._worker = None
        self._ctx = None


def check(request: Any, what: str) -> None:
    """Raise the mapped Lynx error if a completed UCX request failed."""
    try:
        request.check_error()
    except Exception as exc:
        lib = _lib()
        if isinstance(exc, lib.UCXMessageTruncatedError):
            raise ProtocolError(f"{what}: the peer sent more bytes than the manifest "
                                f"announced ({exc})") from exc
        if isinstance(exc, _peer_errors(lib)):
            raise PeerDisconnectedError(f"{what}: the peer went away mid-transfer ({exc})") from exc
        raise TransportError(f"{what}: UCX request failed: {exc}") from exc


def _peer_errors(lib: Any) -> tuple[type, ...]:
    """UCX statuses that mean the other process is gone or unreachable."""
    return (lib.UCXIOError, lib.UCXConnectionResetError, lib.UCXEndpointTimeoutError,
            lib.UCXUnreachableError, lib.UCXNotConnectedError)


def as_bytes_view(buffer: Any) -> Any:
    """A flat ``uint8`` view of a contiguous host (buffer protocol) or CUDA array; no copy."""
    if hasattr(buffer, "__cuda_array_interface__"):
        import cupy  # noqa: PLC0415

        arr = cupy.asarray(buffer)
        if not arr.flags.c_contiguous:
            raise ValueError("CUDA region buffers must be C-contiguous")
        return arr.reshape(-1).view(cupy.uint8)
    import numpy as np  # noqa: PLC0415

    arr = np.asarray(memoryview(buffer)) if not isinstance(buffer, np.ndarray) else buffer
    if not arr.flags.c_contiguous:
        raise ValueError("region buffers must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


def ensure_cuda_context(device: int) -> None:
    """Make ``device``'s primary CUDA context current in the calling thread (UCX needs it)."""
    from ucxx._cuda_context import ensure_cuda_context as ensure  # noqa: PLC0415

    ensure(device)
