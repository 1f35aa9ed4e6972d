"""The one adapter between Lynx and ucxx.

Everything UCX goes through here: ucxx is imported lazily (importing it writes
``UCX_*`` environment variables, so it must never happen at ``lynx_transport``
import) and only through :func:`_import_ucxx` (see there for the one variable
Lynx itself sets, ``UCX_MEMTYPE_CACHE``), the context is configured through
``config_dict`` (never the environment), and ucxx exceptions are translated into
:mod:`lynx_transport.errors` in :func:`check`.

We use ucxx's low-level API (``ucxx._lib.libucxx``): one worker per I/O thread,
progressed by that thread (polling while requests are pending, blocking on the
worker's epoll fd when idle). Endpoints are created from the receiver's worker
address (exchanged on the control channel) without peer-error handling, which
keeps UCX's shared-memory transports available; peer loss is detected by the
control channel instead.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from lynx_transport.errors import ConnectError, PeerDisconnectedError, ProtocolError, TransportError

__all__ = ["UcxWorker", "check", "cancel", "ensure_cuda_context"]

log = logging.getLogger("lynx_transport")

#: How many workers were parked (see ``UcxWorker.close``).
PARKED = 0


def _park(obj: Any) -> None:
    """Keep ``obj`` alive for the life of the process, through interpreter shutdown too.

    A module-level list is cleared when the interpreter finalizes (which would
    run the destructor after all); an extra reference count is not.
    """
    import ctypes  # noqa: PLC0415

    global PARKED
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    PARKED += 1


#: The variable ucxx sets too late (see :func:`_import_ucxx`) and the value it wants.
MEMTYPE_CACHE = ("UCX_MEMTYPE_CACHE", "n")


@functools.cache
def _import_ucxx() -> None:
    """Import ucxx, once per process, with ``UCX_MEMTYPE_CACHE`` already in place.

    The one place Lynx writes the environment, at the first UCX start (never at
    import). ucxx's ``__init__`` sets ``UCX_MEMTYPE_CACHE=n`` (which it needs for
    CUDA memory) *after* it has loaded libucs, but that variable is a UCS global
    option, parsed when libucs loads: the write is lost for this process, and
    UCX's unused-variable check then prints ``UCX  WARN  unused environment
    variable: UCX_MEMTYPE_CACHE`` at the first UCX context. Child processes
    inherit the variable and do apply it. Setting it here, before libucs loads,
    gives every process the value ucxx asks for and no warning. A value of the
    user's own is kept. Nothing is silenced (``UCX_WARN_UNUSED_ENV_VARS`` is left
    alone), so a mistyped ``UCX_*`` variable is still reported. Had the
    embedding program imported ucxx before, libucs is loaded already and this
    cannot help (ucxx's warning then shows once).
    """
    name, value = MEMTYPE_CACHE
    os.environ.setdefault(name, value)
    import ucxx  # noqa: F401, PLC0415 - lazy: writes UCX_* env vars


def _lib() -> Any:
    _import_ucxx()
    import ucxx._lib.libucxx as libucxx  # noqa: PLC0415 - lazy, see _import_ucxx

    return libucxx


def _array(view: Any) -> Any:
    _import_ucxx()
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

    def unexpected_messages(self) -> bool:
        """True when a tagged message arrived that no posted receive matched (yet)."""
        try:
            return bool(self._worker.tag_probe(self._lib.UCXXTag(0), self._lib.UCXXTagMask(0)).matched)
        except Exception:  # noqa: BLE001 - treat an unknown state as "yes": the safe side
            return True

    def close(self) -> None:
        """Release the worker and context (on the owning thread, after its requests).

        ucxx's worker destructor receives every message still waiting in UCX's
        unexpected queue; for a rendezvous message whose sender has died that
        crashed UCX 1.21 (``ucp_proto_rndv_send_reply``, seen after a SIGSTOPped
        then SIGKILLed sender). Such messages arrive only from a faulty or
        hostile peer (sends for a failed or cancelled stream, bogus tags), so
        a worker that still holds any is parked for the life of the process
        instead of destroyed (a bounded leak, logged), and the same reference
        keeps a request freed later by another thread from destroying it there.
        """
        if self._worker is not None:
            try:
                self._worker.progress()
            except Exception:  # noqa: BLE001 - best effort while tearing down
                pass
            if self.unexpected_messages():
                log.warning("UCX worker closed with undelivered messages from a failed peer; "
                            "keeping it (not destroyed) to avoid a UCX crash")
                _park(self._worker)
                _park(self._ctx)
        self._worker = None
        self._ctx = None


_CANCEL: Any = None


def cancel(request: Any) -> None:
    """Cancel a pending UCX request now (it completes with a cancelled status on progress).

    ucxx's Python API has no ``cancel``; dropping the last Python reference
    cancels too, but any other reference (a stored traceback's frame, say)
    silently keeps a receive posted, so a failed stream's receives are
    cancelled explicitly through ucxx's ``ucxx::Request::cancel()``.
    """
    global _CANCEL
    if request.completed:
        return
    if _CANCEL is None:
        _CANCEL = _find_cancel()
    if _CANCEL is not False:
        _CANCEL(request.ucxx_ptr)


def _find_cancel() -> Any:
    """``ucxx::Request::cancel`` from the libucxx wheel, or False (then dropping must do)."""
    import ctypes  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    try:
        import libucxx  # noqa: PLC0415 - the wheel that ships libucxx.so

        so = next(pathlib.Path(next(iter(libucxx.__path__))).glob("lib*/libucxx.so"))
        fn = ctypes.CDLL(str(so))._ZN4ucxx7Request6cancelEv
    except (ImportError, StopIteration, OSError, AttributeError) as exc:
        log.warning("cannot cancel UCX requests explicitly (%s); relying on dropping them", exc)
        return False
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = None
    return fn


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


def ensure_cuda_context(device: int) -> None:
    """Make ``device``'s primary CUDA context current in the calling thread (UCX needs it)."""
    _import_ucxx()
    from ucxx._cuda_context import ensure_cuda_context as ensure  # noqa: PLC0415

    ensure(device)
