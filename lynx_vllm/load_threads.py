"""Load threads: a consumer's loads are written into the request's paged blocks by Lynx
threads (``lynx-load_*``), each layer as soon as every plane of it has landed, whichever way vLLM
waits for them.

- **Synchronous** (``load: "sync"``, the default): :meth:`LoadThreads.start` (from
  ``start_load_kv``, before the step's forward) sends the pull and starts the load's thread;
  vLLM's forward then waits in ``wait_for_layer_load`` for exactly the layer it needs
  (:meth:`LoadThreads.wait_written`), and :meth:`LoadThreads.end` (after the last layer) stops
  and joins the thread before the connector reports the load. The thread decodes and writes
  layer ``L + 1`` while the forward computes layer ``L``, so the forward's own wait per layer is
  the transfer's and nothing more: a LYNX cache, whose residuals come after every anchor, lands
  its layers in a burst at the end, and a forward that decoded each one itself fell behind that
  burst (docs/design.md, "The price of a synchronous load").
- **Asynchronous** (``load: "async"``), vLLM's side of the contract (``KVConnectorBase_V1``): the
  scheduler's ``get_num_new_matched_tokens`` answered ``(n, True)``, so vLLM allocated the
  request's blocks and parked it in ``WAITING_FOR_REMOTE_KVS``; it is not scheduled, and its
  blocks are neither freed nor shared (vLLM caches them only once the load is reported), until
  the worker's ``get_finished`` names it as finished receiving. Failed blocks must reach
  ``get_block_ids_with_load_errors`` no later than the step that names it.
  :meth:`~LoadThreads.submit` (from ``start_load_kv``) sends the pull and starts the thread,
  which writes only the blocks the load owns (:attr:`LoadSpec.own_blocks
  <lynx_vllm.plan.LoadSpec.own_blocks>`), then ends the stream and puts the load on the done
  queue; every write has returned before the load is on that queue. :meth:`~LoadThreads.collect`
  (from ``get_finished``) takes what is on the queue: the request ids to report as finished
  receiving, and the specs of the loads that failed, whose blocks the connector reports in the
  same step. A request vLLM finished (aborted) while its load runs is cancelled: its stream is
  abandoned, its thread stops before its next write, and it is reported (its blocks are vLLM's
  again) once the thread is out.

Concurrency: vLLM's model runner talks to the load threads only through the methods of
:class:`LoadThreads`; an asynchronous load comes back through one queue, a synchronous one
through its :class:`LoadJob`. Nothing blocks the worker's thread but the pull's send, a
synchronous load's per-layer wait, and one short sleep per step while asynchronous loads are in
flight (:data:`YIELD_S`, in :meth:`~LoadThreads.collect`); every wait of a load thread is
bounded by the connector's ``timeout_s``.

Why the sleep: Lynx's receiver and load threads run Python in vLLM's worker
process, and between steps vLLM's worker spins on its shared-memory queue
(``sched_yield``, dropping and retaking the GIL at once), as its forward passes
drop and retake it around every op. CPython hands the GIL to a waiting thread
only when no other thread took it within the switch interval, and a thread
that retakes it that often always has, so without the sleep the receiver can
starve. For the same reason the worker must not be bound to one CPU (vLLM's
``VLLM_CPU_OMP_THREADS_BIND``, which the load threads inherit): its step loop
never blocks, and a receiver on its core did not get to run (docs/design.md,
"The price of a synchronous load", has what was measured). A synchronous load
sees neither: the forward blocks in ``wait_for_layer_load``, core and GIL free.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lynx_vllm.config import LoadMode
from lynx_vllm.consumer import KVLoader, Load
from lynx_vllm.errors import LoadError
from lynx_vllm.plan import LoadSpec

__all__ = ["LoadJob", "LoadThreads", "Writer", "THREADS", "YIELD_S"]

log = logging.getLogger("lynx_vllm.load_threads")

#: ``write(spec, layer, k, v)``: put layer ``layer``'s K and V (float32 ``[kv_heads, tokens, head_dim]``,
#: every token of the cache) into the request's blocks, tokens ``[spec.start, spec.end)``.
Writer = Callable[[LoadSpec, int, Any, Any], None]

#: Load threads: loads past this many at once wait for a thread (their bytes land meanwhile).
THREADS = 4

#: The worker thread's sleep per step while asynchronous loads are in flight: the window in which
#: this process's Lynx threads get the GIL (see the module docstring); each step is that much longer
#: meanwhile.
YIELD_S = 0.005

#: How long past its load's deadline a synchronous wait for a layer, or for a stopping thread, goes
#: on (the thread's own waits end at the deadline; this covers its last decode and write).
GRACE_S = 5.0


@dataclasses.dataclass(eq=False)
class LoadJob:
    """One load on its thread: ``written`` layers (in order) are in the request's blocks; ``out``
    once the thread has returned (whatever the outcome)."""

    spec: LoadSpec
    load: Load
    mode: LoadMode = LoadMode.ASYNC
    written: int = 0
    out: bool = False
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    changed: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    future: cf.Future[None] | None = None


class LoadThreads:
    """A consumer worker's load threads (see the module docstring). ``layers``: the model's layer
    count (every one is written before a load is reported)."""

    def __init__(self, loader: KVLoader, layers: int, write: Writer, *, threads: int = THREADS,
                 yield_s: float = YIELD_S) -> None:
        self._loader = loader
        self._yield_s = yield_s
        self._layers = layers
        self._write = write
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="lynx-load")
        self._lock = threading.Lock()
        self._jobs: dict[str, LoadJob] = {}  # asynchronous loads by request id, until collected
        self._sync: set[LoadJob] = set()  # synchronous loads until ended
        self._done: queue.SimpleQueue[LoadJob] = queue.SimpleQueue()
        self._closed = False

    # -- synchronous loads ---------------------------------------------------------------------
    def start(self, spec: LoadSpec) -> LoadJob:
        """Send ``spec``'s pull and start writing its layers as they land; the forward then waits
        in :meth:`wait_written`, and :meth:`end` closes the load. Never raises for the load's sake
        (a pull that fails makes a job whose load has failed)."""
        return self._launch(spec, LoadMode.SYNC)

    def wait_written(self, job: LoadJob, index: int) -> bool:
        """Wait until layer ``index`` of a synchronous load is in the request's blocks: True, or
        False once the load has failed (its error is on the load; past its deadline plus
        :data:`GRACE_S` the load is failed here)."""
        deadline = job.load.deadline + GRACE_S
        with job.changed:
            while job.written <= index and not job.out and not job.load.failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                job.changed.wait(min(left, 1.0))
            if job.written > index:
                return True
        if not job.load.failed:
            self._loader.cancel(job.load, f"layer {index} was not written by the load's deadline")
        return False

    def end(self, job: LoadJob) -> None:
        """Close a synchronous load before the connector reports it: a thread still short of the last
        layer is cancelled, and the thread is out (no write of it can follow) before this returns."""
        with job.changed:
            stop = not job.out and job.written < self._layers
        if stop:
            job.cancelled.set()
            self._loader.cancel(job.load, "the forward ended before the load's last layer")
        with job.changed:
            job.changed.wait_for(lambda: job.out, max(0.0, job.load.deadline + GRACE_S - time.monotonic()))
            out = job.out
        with self._lock:
            self._sync.discard(job)
        if not out:  # never seen: a write that does not return
            log.error("the load thread of %s did not stop; its blocks are reported failed", job.spec.request_id)
            self._loader.fail(job.load, LoadError("the load thread did not stop"))

    # -- asynchronous loads --------------------------------------------------------------------
    def submit(self, spec: LoadSpec) -> Load:
        """Send ``spec``'s pull and start its load on a load thread. Never raises for the load's
        sake: a pull that fails makes a load that is reported failed by the next :meth:`collect`."""
        return self._launch(spec, LoadMode.ASYNC).load

    def pending(self) -> int:
        """Asynchronous loads submitted and not yet collected."""
        with self._lock:
            return len(self._jobs)

    def collect(self, finished: Iterable[str] = ()) -> tuple[set[str], list[LoadSpec]]:
        """``(request ids whose asynchronous load ended, the specs of those that failed)``, each load
        once: every write of a reported load has returned. ``finished``: requests vLLM finished
        (aborted); their loads still running are cancelled, and reported once their thread is out (a
        cancelled load is not counted as failed: its request is gone). While loads are in flight it
        first sleeps ``yield_s``, so that the load threads and the receiver get the GIL (the module
        docstring)."""
        with self._lock:
            doomed = [self._jobs[r] for r in finished if r in self._jobs]
            busy = bool(self._jobs)
        if busy and self._yield_s > 0:
            time.sleep(self._yield_s)
        for job in doomed:
            if not job.cancelled.is_set():
                job.cancelled.set()
                self._loader.cancel(job.load, "vLLM finished the request before its load")
        ended: set[str] = set()
        failed: list[LoadSpec] = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._jobs.pop(job.spec.request_id, None)
            job.load.times["reported_at"] = time.time()
            self._loader.write_record(job.load.record())
            ended.add(job.spec.request_id)
            if job.load.failed and not job.cancelled.is_set():
                failed.append(job.spec)
        return ended, failed

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every load still running and wait (up to ``timeout_s``) for their threads."""
        with self._lock:
            self._closed = True
            jobs = [*self._jobs.values(), *self._sync]
        for job in jobs:
            job.cancelled.set()
            self._loader.cancel(job.load, "the connector is shutting down")
        cf.wait([job.future for job in jobs if job.future is not None], timeout=timeout_s)
        self._pool.shutdown(wait=False)

    # -- a load thread -------------------------------------------------------------------------
    def _launch(self, spec: LoadSpec, mode: LoadMode) -> LoadJob:
        """Send the pull and hand the load to a thread (or, once closed, end it at once)."""
        load = self._loader.start(spec.request_id, spec.transfer.producer, spec.prompt_ids,
                                  scheme=spec.scheme, planes=spec.planes, mode=mode)
        job = LoadJob(spec, load, mode)
        with self._lock:
            if mode is LoadMode.ASYNC:
                self._jobs[spec.request_id] = job
            else:
                self._sync.add(job)
            closed = self._closed
        if closed:
            self._loader.cancel(load, "the connector is shutting down")
            self._finally(job)
        else:
            job.future = self._pool.submit(self._run, job)
        return job

    def _run(self, job: LoadJob) -> None:
        spec, load = job.spec, job.load
        index = 0
        try:
            for index in range(self._layers):
                if load.failed or job.cancelled.is_set():
                    break
                try:
                    k, v = self._loader.layer(load, index)
                except LoadError:
                    break  # the load is marked failed
                if job.cancelled.is_set():
                    break
                self._write(spec, index, k, v)
                load.tokens_loaded = spec.end - spec.start
                with job.changed:
                    job.written = index + 1
                    job.changed.notify_all()
            else:
                load.times["written_at"] = time.time()
        except Exception as exc:  # noqa: BLE001 - any failure of a load fails that request, not the engine
            self._loader.fail(load, LoadError(f"loading layer {index}: {type(exc).__name__}: {exc}"))
        finally:
            self._finally(job)

    def _finally(self, job: LoadJob) -> None:
        """A load's thread is out: an asynchronous load goes on the done queue, a synchronous one's
        waiters are woken (the connector ends it)."""
        if job.mode is LoadMode.ASYNC:
            self._end(job)
        else:
            self._out(job)

    def _out(self, job: LoadJob) -> None:
        with job.changed:
            job.out = True
            job.changed.notify_all()

    def _end(self, job: LoadJob) -> None:
        try:
            self._loader.finish(job.load, write=False)
        except Exception as exc:  # noqa: BLE001 - the load is reported whatever ending its stream did
            log.warning("could not end the load of %s: %s", job.spec.request_id, exc)
        self._out(job)
        self._done.put(job)
