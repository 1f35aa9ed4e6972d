"""The receive pool: one buffer allocated once, carved into stream regions.

Incoming bytes land directly in the pool (UCX receives are posted on views of
it), so a region handed to the user is a NumPy (or CuPy) view into the pool,
never a copy. Allocation is first-fit over a sorted free list with coalescing;
a stream's regions are allocated all at once or not at all, and a request that
does not fit raises :class:`~lynx_transport.errors.PoolExhaustedError` instead
of touching live data. Thread-safe: the I/O thread allocates, users release.
"""

from __future__ import annotations

import bisect
import enum
import threading
from typing import Any

from lynx_transport.errors import BackendError, PoolExhaustedError

__all__ = ["PoolMemory", "ReceivePool"]

ALIGNMENT = 256
HUGE_PAGE = 2 << 20  # host buffers start on a 2 MiB boundary, so THP can back all of them


def host_buffer(nbytes: int, *, touch: bool) -> Any:
    """``nbytes`` zero bytes of host memory (NumPy ``uint8``) starting on a 2 MiB boundary.

    ``touch``: write every page now, so later writes (a transfer landing) take no
    first-touch page faults. Without it the pages are never written (calloc'd):
    reads map the kernel's zero page - the 2 MiB huge zero page, as NumPy asks
    for transparent huge pages for large arrays - like ``ucx_perftest``'s buffers
    (UCX's allocator makes them huge-page eligible too; checked in its smaps).
    """
    import numpy as np  # noqa: PLC0415

    raw = np.zeros(nbytes + HUGE_PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE
    out = raw[start:start + nbytes]
    if touch:
        out.fill(0)
    return out


class PoolMemory(enum.Enum):
    """Where the pool lives."""

    HOST = "host"   # NumPy host memory, 2 MiB-aligned
    CUDA = "cuda"   # CuPy device memory on the current device (needs the `gpu` extra)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class ReceivePool:
    """A pre-allocated receive buffer of ``nbytes`` bytes in ``memory``.

    Host pools start on a 2 MiB boundary (so transparent huge pages, which
    NumPy requests for large arrays, can back all of them) and are pre-faulted (every page written once) at
    creation, so transfers never pay for first-touch page faults. ucxx exposes
    no explicit memory registration; UCX registers the pool on first use
    (where the transport needs it, e.g. RDMA) and keeps it in its
    registration cache, so the one-time cost is paid by the first stream.

    ``buffer`` is the whole pool as a 1-D ``uint8`` array (NumPy or CuPy).
    """

    def __init__(self, nbytes: int, memory: PoolMemory = PoolMemory.HOST) -> None:
        if not isinstance(nbytes, int) or nbytes < ALIGNMENT:
            raise ValueError(f"pool size must be an int >= {ALIGNMENT} bytes, got {nbytes!r}")
        self.memory = PoolMemory(memory)
        self.nbytes = nbytes
        #: CUDA device id of a CUDA pool (``None`` for host memory).
        self.device: int | None = None
        if self.memory is PoolMemory.HOST:
            # Touch every page now, so no transfer pays a first-touch page fault
            # per 4 KiB page (that cuts the receive rate; docs/design.md).
            self.buffer: Any = host_buffer(nbytes, touch=True)
            self._base = int(self.buffer.ctypes.data)
        else:
            try:
                import cupy  # noqa: PLC0415

                self.buffer = cupy.empty(nbytes, dtype=cupy.uint8)
                self.device = int(self.buffer.device.id)
            except Exception as exc:  # ImportError or any CUDA failure
                raise BackendError(f"cannot allocate a {nbytes}-byte CUDA pool: {exc} "
                                   "(install the `gpu` extra and run on a GPU host)") from exc
            self._base = int(self.buffer.data.ptr)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size)

    # -- allocation ------------------------------------------------------------
    def allocate(self, sizes: list[int]) -> list[int]:
        """Carve one block per size (all or nothing); returns their offsets.

        Raises :class:`PoolExhaustedError` when they do not fit right now.
        """
        with self._lock:
            trial = list(self._free)
            offsets = []
            for size in sizes:
                need = _round_up(max(size, 1), ALIGNMENT)
                for i, (off, free) in enumerate(trial):
                    if free >= need:
                        offsets.append(off)
                        if free == need:
                            del trial[i]
                        else:
                            trial[i] = (off + need, free - need)
                        break
                else:
                    total = sum(_round_up(max(s, 1), ALIGNMENT) for s in sizes)
                    raise PoolExhaustedError(
                        f"the receive pool cannot hold {total} more bytes "
                        f"({self._free_bytes_locked()} of {self.nbytes} free, largest block "
                        f"{max((f for _, f in self._free), default=0)}); release finished "
                        "streams or create a larger pool")
            self._free = trial
            return offsets

    def release(self, offset: int, size: int) -> None:
        """Give a block from :meth:`allocate` back."""
        need = _round_up(max(size, 1), ALIGNMENT)
        with self._lock:
            i = bisect.bisect_left(self._free, (offset, 0))
            if (i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > offset) or (
                    i < len(self._free) and offset + need > self._free[i][0]):
                raise ValueError(f"block at {offset} (+{need}) is already free")
            self._free.insert(i, (offset, need))
            # coalesce with the right, then the left neighbour
            if i + 1 < len(self._free) and offset + need == self._free[i + 1][0]:
                self._free[i] = (offset, need + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]

    # -- views -----------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> Any:
        """A ``uint8`` view of ``nbytes`` at ``offset`` (no copy)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + nbytes}) is outside the pool")
        return self.buffer[offset:offset + nbytes]

    @property
    def base_address(self) -> int:
        """Address of the pool's first byte (host or device pointer)."""
        return self._base

    def _free_bytes_locked(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes_locked()

    @property
    def used_bytes(self) -> int:
        return self.nbytes - self.free_bytes
