"""Thread niceness for the transport's own threads (see ``TransportConfig.thread_nice``)."""

from __future__ import annotations

import logging
import os

__all__ = ["renice_current_thread"]

log = logging.getLogger("lynx_transport")


def renice_current_thread(increment: int) -> None:
    """Add ``increment`` to the calling thread's niceness (Linux: per thread), clamped to
    [-20, 19]. A negative increment needs ``CAP_SYS_NICE``; without it the thread keeps
    its priority and a warning is logged."""
    if increment == 0:
        return
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)  # Linux: 0 = the calling thread
        os.setpriority(os.PRIO_PROCESS, 0, max(-20, min(19, current + increment)))
    except (OSError, AttributeError) as exc:
        log.warning("cannot change the niceness of a transport thread by %+d: %s", increment, exc)
