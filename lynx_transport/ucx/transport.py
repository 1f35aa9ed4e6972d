"""The real :class:`~lynx_transport.seam.Transport`: UCX data path, TCP control channel.

:data:`UCX` is the one instance (re-exported as ``lynx_transport.UCX``), the default
transport of every node; ``lynx_transport.testing.MemoryTransport`` is its in-memory twin.
"""

from __future__ import annotations

from lynx_transport.config import TransportConfig
from lynx_transport.protocol.pool import ReceivePool
from lynx_transport.seam import EgressLike, Listener, ReceiverCallbacks, Sender, Transport
from lynx_transport.ucx.connection import connect
from lynx_transport.ucx.egress import Egress
from lynx_transport.ucx.receiver import Receiver

__all__ = ["UCX", "UcxTransport"]


class UcxTransport:
    """The real transport (:mod:`lynx_transport.ucx.connection`, :mod:`lynx_transport.ucx.egress`,
    :mod:`lynx_transport.ucx.receiver`). Stateless; use the :data:`UCX` instance."""

    def __repr__(self) -> str:
        return "UCX"

    def connect(self, address: tuple[str, int], *, timeout: float,
                config: TransportConfig | None = None) -> Sender:
        return connect(address, timeout=timeout, config=config)

    def egress(self, config: TransportConfig | None = None) -> EgressLike:
        """A shared egress (:class:`~lynx_transport.ucx.egress.Egress`) for a sending node
        with several receivers; starts UCX at once. The caller closes it."""
        return Egress(config)

    def listen(self, pool: ReceivePool, *, host: str = "127.0.0.1", port: int = 0,
               config: TransportConfig | None = None,
               callbacks: ReceiverCallbacks | None = None) -> Listener:
        return Receiver(pool, host=host, port=port, config=config,
                        **(callbacks or ReceiverCallbacks()).as_kwargs())


#: The real transport (UCX + TCP control); the default of every node.
UCX: Transport = UcxTransport()
