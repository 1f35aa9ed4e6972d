"""Pool admission without I/O: arrival order, waiting until the deadline, refusing what never fits."""

from __future__ import annotations

from lynx_transport.protocol.admission import AdmissionQueue, Admit, Refuse, Wait
from lynx_transport.protocol.clock import VirtualClock
from lynx_transport.protocol.manifest import Manifest, RegionSpec
from lynx_transport.protocol.pool import ALIGNMENT, ReceivePool


def manifest(sid: int, *sizes: int) -> Manifest:
    return Manifest(sid, 1 << 20, tuple(RegionSpec(f"r{i}", n, 0) for i, n in enumerate(sizes)))


class Peer:
    def __init__(self) -> None:
        self.closed = False


def test_what_fits_is_admitted_in_arrival_order_with_its_offsets() -> None:
    pool = ReceivePool(8 * ALIGNMENT)
    queue: AdmissionQueue[Peer] = AdmissionQueue(pool, 1.0)
    peer = Peer()
    queue.add(peer, manifest(1, ALIGNMENT, ALIGNMENT), 0.0)
    queue.add(peer, manifest(2, 2 * ALIGNMENT), 0.0)
    first, second = queue.next(0.0), queue.next(0.0)
    assert isinstance(first, Admit) and first.manifest.stream_id == 1 and first.peer is peer
    assert isinstance(second, Admit) and second.manifest.stream_id == 2
    assert len(set(first.offsets + second.offsets)) == 3
    assert queue.next(0.0) is None and not queue
    assert pool.used_bytes == 4 * ALIGNMENT


def test_a_manifest_waits_until_its_deadline_and_blocks_those_behind_it() -> None:
    clock = VirtualClock()
    pool = ReceivePool(4 * ALIGNMENT)
    (held,) = pool.allocate([3 * ALIGNMENT])
    queue: AdmissionQueue[Peer] = AdmissionQueue(pool, 2.0)
    peer = Peer()
    queue.add(peer, manifest(1, 2 * ALIGNMENT), clock.now())
    clock.advance(0.5)
    queue.add(peer, manifest(2, ALIGNMENT), clock.now())  # would fit, but arrived later
    assert queue.next(clock.now()) == Wait(2.0)
    assert queue.holds(peer, 1) and queue.holds(peer, 2)
    pool.release(held, 3 * ALIGNMENT)
    admitted = queue.next(clock.now())
    assert isinstance(admitted, Admit) and admitted.manifest.stream_id == 1


def test_past_its_deadline_a_manifest_is_refused_and_the_next_one_is_decided() -> None:
    clock = VirtualClock()
    pool = ReceivePool(4 * ALIGNMENT)
    pool.allocate([3 * ALIGNMENT])
    queue: AdmissionQueue[Peer] = AdmissionQueue(pool, 2.0)
    peer = Peer()
    queue.add(peer, manifest(1, 2 * ALIGNMENT), clock.now())
    queue.add(peer, manifest(2, ALIGNMENT), clock.now())
    clock.advance(2.0)
    refused = queue.next(clock.now())
    assert isinstance(refused, Refuse) and refused.manifest.stream_id == 1
    assert "cannot hold" in str(refused.error)
    admitted = queue.next(clock.now())
    assert isinstance(admitted, Admit) and admitted.manifest.stream_id == 2


def test_a_manifest_larger_than_the_pool_is_refused_at_once() -> None:
    queue: AdmissionQueue[Peer] = AdmissionQueue(ReceivePool(4 * ALIGNMENT), 60.0)
    queue.add(Peer(), manifest(7, 8 * ALIGNMENT), 0.0)
    assert isinstance(queue.next(0.0), Refuse)
    assert not queue


def test_discarded_and_gone_peers_are_skipped() -> None:
    pool = ReceivePool(8 * ALIGNMENT)
    queue: AdmissionQueue[Peer] = AdmissionQueue(pool, 1.0, lambda peer: peer.closed)
    a, b, c = Peer(), Peer(), Peer()
    queue.add(a, manifest(1, ALIGNMENT), 0.0)
    queue.add(a, manifest(2, ALIGNMENT), 0.0)
    queue.add(b, manifest(1, ALIGNMENT), 0.0)
    queue.add(c, manifest(1, ALIGNMENT), 0.0)
    queue.discard(a, 1)
    assert not queue.holds(a, 1) and queue.holds(a, 2)
    b.closed = True
    queue.discard(c)
    admitted = queue.next(0.0)
    assert isinstance(admitted, Admit) and admitted.peer is a and admitted.manifest.stream_id == 2
    assert queue.next(0.0) is None
    assert pool.used_bytes == ALIGNMENT  # the closed peer's manifest took no space
