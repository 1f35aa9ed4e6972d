"""The real transport: UCX data path, TCP control channel.

Its public classes are exported by :mod:`lynx_transport` (``Receiver``, ``Connection``,
``connect``, ``Egress``, and ``UCX``, the :class:`~lynx_transport.seam.Transport` that
:mod:`~lynx_transport.ucx.transport` builds from them); the modules here are the
implementation.

* :mod:`~lynx_transport.ucx.adapter`: the one module that touches ucxx (imported
  lazily, at the first UCX start, never at import) and maps its errors;
* :mod:`~lynx_transport.ucx.loop`: ``IoLoop``, the I/O thread that owns a UCX worker,
  the control sockets and all mutable state; others reach it through futures;
* :mod:`~lynx_transport.ucx.control` (a control socket: frames, keep-alive) and
  :mod:`~lynx_transport.ucx.heartbeat` (the thread that sends the heartbeats);
* the receiving side: :mod:`~lynx_transport.ucx.receiver` (``Receiver``), its I/O
  thread :mod:`~lynx_transport.ucx.receiver_loop`, what happens to an admitted stream
  :mod:`~lynx_transport.ucx.receiver_streams`, its extra UCX workers
  :mod:`~lynx_transport.ucx.receiver_rail`, the per-peer and per-stream records
  :mod:`~lynx_transport.ucx.receiver_state`, and failed streams' leftovers
  :mod:`~lynx_transport.ucx.receiver_quarantine`;
* :mod:`~lynx_transport.ucx.transport`: ``UcxTransport`` and its one instance ``UCX``;
* the sending side: :mod:`~lynx_transport.ucx.egress` (``Egress``),
  :mod:`~lynx_transport.ucx.connection` (``Connection``, ``connect``, the handshake)
  and their I/O thread :mod:`~lynx_transport.ucx.sender_loop`, with its per-peer and
  per-stream records :mod:`~lynx_transport.ucx.sender_state`.

Imports point one way: these modules import ``lynx_transport.protocol`` and the
top-level modules (the stream handles, config, errors, ...), never
``lynx_transport.memory`` (``tests/unit/test_import_cycles.py`` checks it).
Importing this package imports none of its modules, and none of them imports ucxx
at import time.
"""
