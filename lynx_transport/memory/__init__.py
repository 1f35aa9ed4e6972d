"""The in-memory twin of the UCX transport: no sockets, no UCX, the same semantics.

:class:`~lynx_transport.memory.transport.MemoryTransport` (exported as
``lynx_transport.testing.MemoryTransport``) implements
:class:`lynx_transport.seam.Transport` for fast tests of the layers above; it passes
the one conformance suite the UCX transport passes
(``tests/unit/test_transport_conformance.py``).

* :mod:`~lynx_transport.memory.transport`: the network (``MemoryTransport``) and the
  receiving side (``MemoryListener``);
* :mod:`~lynx_transport.memory.egress`: the sending side (``MemoryEgress``,
  ``MemorySender``);
* :mod:`~lynx_transport.memory.loop`: the one thread that owns the network's state.

It shares the transport's own parts wherever they are not UCX (``lynx_transport.protocol``,
the stream handles, ``_dispatch``, ``_opened``) and imports nothing from
``lynx_transport.ucx`` (``tests/unit/test_import_cycles.py`` checks it). Importing this
package imports none of its modules.
"""
