"""The transport's pure logic: what both transports (UCX and the in-memory twin) share.

No UCX, no sockets, no threads of its own: each piece takes bytes and a clock, so
the tests drive it with :class:`~lynx_transport.protocol.clock.VirtualClock`.

* :mod:`~lynx_transport.protocol.wire`: control frames (header, payloads, the
  incremental bounded decoder);
* :mod:`~lynx_transport.protocol.manifest`: a stream's regions, sizes, lanes and
  metadata, validated against ``ManifestLimits`` before anything is allocated;
* :mod:`~lynx_transport.protocol.scheduler`: which chunk goes next (lane priority,
  the lane policy, the bytes-in-flight bound);
* :mod:`~lynx_transport.protocol.shaper`: token buckets (link, peer cap, lanes);
* :mod:`~lynx_transport.protocol.pool`: the receive pool (first-fit, all or nothing);
* :mod:`~lynx_transport.protocol.admission`: manifests waiting for pool space, decided
  in arrival order (admit, refuse, wait) for both receivers;
* :mod:`~lynx_transport.protocol.auth`: the shared-secret handshake's MACs and steps;
* :mod:`~lynx_transport.protocol.clock`: ``Clock``, ``MonotonicClock``, ``VirtualClock``;
* :mod:`~lynx_transport.protocol.views`: a region buffer as flat bytes (host or CUDA).

Imports point one way: these modules import only each other and the leaf modules
``lynx_transport.errors`` and ``lynx_transport.lanes``, never ``lynx_transport.ucx``
or ``lynx_transport.memory`` (``tests/unit/test_import_cycles.py`` checks it).
Importing this package imports none of its modules.
"""
