"""The I/O thread: one per UCX worker. Progress, control sockets and scheduling in one place.

Concurrency model (threads + futures): each :class:`IoLoop` owns a UCX worker,
its control sockets and all mutable transport state. Other threads talk to it
through :meth:`IoLoop.call`, which runs a function on the loop and returns a
:class:`concurrent.futures.Future`. Whoever touches that state holds the loop's
owner lock: the loop's thread holds it for every round and lets go of it only
while it waits (``select``, a nap, a yield). A loop with ``inline_calls`` (the
sender's, ``TransportConfig.send_from_caller``) lets a caller that finds the lock
free run its call on its own thread and then hand what the call scheduled to UCX
(:meth:`IoLoop.after_inline_call`), instead of queueing it and waking the loop's
thread: a new stream's first chunk leaves without a thread hand-off (a wake-up
from epoll costs 100-200 us on this project's VMs). The loop's thread is woken
after, to watch the new requests. A caller that finds the lock taken queues its
call as before.

While UCX requests are pending the loop polls the worker, napping
``_NAP_S`` (20 us) between polls, for as long as work moved within the last
``_POLL_WINDOW_S`` (250 us); then it arms the worker and sleeps in ``select``
on the worker's epoll fd, the control sockets and a wake-up socket until UCX
has an event or the next deadline. So a fast transfer is polled (waking
through epoll would cost it throughput), while a slow one (a shaped link: a chunk
every few ms) costs one wake-up per event, not one per nap, and leaves the CPU
to the node's model threads. While requests are pending the sleep is capped
at ``_PENDING_SLEEP_MAX_S`` (50 ms), so a UCX event that never reaches the fd
costs a stall, not a hang.

Latency mode (``busy_poll``, ``TransportConfig.busy_poll``) never sleeps: the
loop polls the worker, its calls and the sockets round after round, giving up
the core (``sched_yield``) between rounds, so a frame, a completion or a call is
seen within one round instead of one wake-up (on this project's VMs a wake-up
from epoll costs 100-200 us). It costs the loop's thread a whole core while the
transport is open. A call's future is settled after the round's :meth:`step`,
in either mode: the woken caller would otherwise take the GIL while this thread
still has the call's chunks to hand to UCX.

A near deadline (the shaper's next token, under ``_PRECISE_SLEEP_S``) is slept
with ``time.sleep``, because epoll rounds up to whole milliseconds; the
sockets are read right after it, before the next scheduling decision, so a
frame that arrived meanwhile (an ACCEPT for an anchor) is not held back by the
chunk that decision sends. While UCX requests are pending, the whole
milliseconds of such a wait are slept on the worker's epoll fd instead and
only the rest with ``time.sleep``: over ``UCX_TLS=tcp`` UCX moves a chunk's
bytes into the socket only while its worker is progressed, so a sender that
slept through each gap between two tokens would send its chunks late under
CPU contention (cma, where the receiver does the copying, is unaffected).

Measured facts behind these constants: docs/design.md, "Measured facts".
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from lynx_transport._threads import renice_current_thread
from lynx_transport.errors import ClosedError, TransportTimeoutError
from lynx_transport.protocol.clock import Clock
from lynx_transport.ucx.adapter import UcxWorker
from lynx_transport.ucx.heartbeat import Heartbeats

__all__ = ["IoLoop"]

log = logging.getLogger("lynx_transport")

_NAP_S = 20e-6                # nap between polls while requests are pending ...
_POLL_WINDOW_S = 250e-6       # ... for this long after the last progress, then sleep on epoll
_PENDING_SLEEP_MAX_S = 0.05   # longest epoll sleep while UCX requests are pending
_SOCKET_POLL_EVERY = 8        # while busy, look at sockets every N iterations
_PRECISE_SLEEP_S = 0.005      # deadlines closer than this are slept precisely


class IoLoop:
    """Base class; subclasses implement :meth:`step` and :meth:`on_crash`."""

    def __init__(self, name: str, tls: str, clock: Clock,
                 thread_init: Callable[[], None] | None = None, net_devices: str = "all",
                 nice: int = 0, worker: UcxWorker | None = None,
                 heartbeat_s: float | None = None, busy_poll: bool = False,
                 inline_calls: bool = False) -> None:
        self.clock = clock
        #: Run a caller's call on the caller's thread when the owner lock is free (above).
        self.inline_calls = inline_calls and thread_init is None
        #: Held by whichever thread touches the loop's state (see the module docstring).
        self._owner = threading.Lock()
        #: The caller's thread while it runs a call inline (a call it makes meanwhile, from
        #: a callback say, runs inline too: queued, it would wait on this very thread).
        self._inline_thread: int | None = None
        #: Latency mode (``TransportConfig.busy_poll``): never sleep, poll UCX and the sockets.
        self.busy_poll = busy_poll
        #: A loop with control sockets (``heartbeat_s`` given) heartbeats them from a
        #: thread of its own (see :mod:`lynx_transport.ucx.heartbeat`); started and
        #: stopped with the loop.
        self.heartbeats = (None if heartbeat_s is None else
                           Heartbeats(name.replace("-io", "") + "-heartbeat", clock, heartbeat_s))
        self._thread_init = thread_init
        self._nice = nice
        self.worker = worker if worker is not None else UcxWorker(tls, net_devices)
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self.selector.register(self.worker.epoll_fd, selectors.EVENT_READ, None)
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque())
        self._calls_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- called from any thread ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self.heartbeats is not None:
            self.heartbeats.start()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the I/O thread; its result or exception lands in the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if (threading.current_thread() is self._thread
                or self._inline_thread == threading.get_ident()):
            self._run_one(fn, fut)
            return fut
        if self.inline_calls and self._run_inline(fn, fut):
            return fut
        with self._calls_lock:
            if self._stopping:
                fut.set_exception(ClosedError("the transport is closed"))
                return fut
            self._calls.append((fn, fut))
        if not self.busy_poll:  # a polling loop looks at the calls every round
            self.wake()
        return fut

    def _run_inline(self, fn: Callable[[], Any], fut: concurrent.futures.Future) -> bool:
        """Run ``fn`` here if the loop's thread is running and waiting (the owner lock is
        free); False if not (then it is queued)."""
        if not self._thread.is_alive() or not self._owner.acquire(blocking=False):
            return False
        try:
            if self._stopping:
                return False
            self._inline_thread = threading.get_ident()
            try:
                outcome = self._outcome(fn, fut)
                try:
                    self.after_inline_call()
                except Exception as exc:  # a bug: the caller hears of it
                    log.exception("lynx I/O work failed on the caller's thread")
                    outcome = (False, exc)
            finally:
                self._inline_thread = None
        finally:
            self._owner.release()
        self._settle(fut, outcome)
        if not self.busy_poll:  # the new requests are the loop's to watch from here
            self.wake()
        return True

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        """:meth:`call` and wait: ``fn``'s result, its exception, or
        :class:`TransportTimeoutError` after ``timeout`` seconds."""
        try:
            return self.call(fn).result(timeout)
        except concurrent.futures.TimeoutError:
            raise TransportTimeoutError(
                f"the {self._thread.name} thread did not answer in {timeout} s") from None

    def discard(self) -> None:
        """Free the resources of a loop that was never started (construction failed)."""
        self.release_ucx()
        self.worker.close()
        self.selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def stop(self, timeout: float) -> None:
        """Ask the loop to finish and wait for it (at most ``timeout`` s)."""
        self._stopping = True
        self.wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- subclass hooks ----------------------------------------------------------------
    def step(self) -> tuple[bool, bool, float | None]:
        """One round of work: ``(made_progress, ucx_pending, next_deadline)``."""
        raise NotImplementedError

    def after_inline_call(self) -> None:
        """Called on a caller's thread, owner lock held, after an inline call: hand to UCX
        what the call made ready (the sender: the scheduler's chunks)."""

    def eager(self) -> bool:
        """Whether pending requests deserve polling now (default: yes); False lets the
        loop sleep on the worker's epoll fd at once, waking on the next UCX event."""
        return True

    def shutdown(self) -> None:
        """Called on the I/O thread when the loop ends (close sockets, fail streams)."""

    def on_crash(self, exc: BaseException) -> None:
        """Called on the I/O thread if :meth:`step` raised unexpectedly."""

    def release_ucx(self) -> None:
        """Drop every UCX request and endpoint (called on the I/O thread at the end)."""

    # -- the loop ------------------------------------------------------------------------
    def _drain_wake(self, sock: socket.socket) -> None:
        try:
            while sock.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    @staticmethod
    def _run_one(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
        IoLoop._settle(fut, IoLoop._outcome(fn, fut))

    @staticmethod
    def _outcome(fn: Callable[[], Any], fut: concurrent.futures.Future) -> tuple[bool, Any] | None:
        """Run ``fn`` for ``fut``: ``(ok, result or exception)``, None if ``fut`` was cancelled."""
        if not fut.set_running_or_notify_cancel():
            return None
        try:
            return True, fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            return False, exc

    @staticmethod
    def _settle(fut: concurrent.futures.Future, outcome: tuple[bool, Any] | None) -> None:
        if outcome is not None:
            (fut.set_result if outcome[0] else fut.set_exception)(outcome[1])

    def _run_calls(self) -> list[tuple[concurrent.futures.Future, tuple[bool, Any] | None]]:
        """Run the queued calls; their futures are settled by the caller, after the round's
        :meth:`step`: a waiter woken earlier takes the GIL while this thread still has the
        call's chunks to hand to UCX."""
        ran: list[tuple[concurrent.futures.Future, tuple[bool, Any] | None]] = []
        while True:
            with self._calls_lock:
                if not self._calls:
                    return ran
                fn, fut = self._calls.popleft()
            ran.append((fut, self._outcome(fn, fut)))

    def _select(self, timeout: float) -> bool:
        events = (self._pause(self.selector.select, timeout) if timeout > 0
                  else self.selector.select(0))
        for key, _ in events:
            if key.data is not None:
                key.data(key.fileobj)
        return bool(events)

    def _pause(self, wait: Callable[..., Any], *args: Any) -> Any:
        """``wait(*args)`` (a select, a nap, a yield) without the owner lock, so a caller may
        run meanwhile; its result."""
        self._owner.release()
        try:
            return wait(*args)
        finally:
            self._owner.acquire()

    def _run(self) -> None:
        self._owner.acquire()
        try:
            renice_current_thread(self._nice)
            if self._thread_init is not None:
                self._thread_init()
            last_progress = 0.0
            n = 0
            while not self._stopping:
                self.worker.progress()
                ran = self._run_calls()
                try:
                    progressed, pending, deadline = self.step()
                finally:  # the calls' waiters, after this round's chunks went to UCX
                    for fut, outcome in ran:
                        self._settle(fut, outcome)
                n += 1
                if progressed or ran:
                    last_progress = time.perf_counter()
                    if n % _SOCKET_POLL_EVERY == 0:
                        self._select(0)
                    continue
                if self.busy_poll:
                    # latency mode: the sockets every round, the core given up to a
                    # runnable thread (not slept away: a wake-up costs more than a poll)
                    self._select(0)
                    self._pause(os.sched_yield)
                    continue
                now = self.clock.now()
                timeout = 1.0 if deadline is None else max(0.0, deadline - now)
                if pending:
                    if self.eager() and time.perf_counter() - last_progress < _POLL_WINDOW_S:
                        if n % _SOCKET_POLL_EVERY == 0:
                            self._select(0)
                        self._pause(time.sleep, min(_NAP_S, timeout))
                        continue
                    timeout = min(timeout, _PENDING_SLEEP_MAX_S)
                if timeout < _PRECISE_SLEEP_S:
                    # a near deadline (the shaper's next token): epoll rounds up
                    # to whole milliseconds, which would cost a shaped link its rate;
                    # then read what arrived meanwhile before the next decision (an
                    # ACCEPT for an anchor must not wait behind another chunk time).
                    # With UCX requests pending, the whole milliseconds of the wait are
                    # slept on the worker's epoll fd (rounded down, so never past the
                    # deadline): over tcp UCX pushes a chunk's bytes only while its
                    # worker is progressed, and a sender asleep between two tokens left
                    # the last chunk half sent (see the module docstring)
                    whole_ms = math.floor(timeout * 1000) / 1000
                    if pending and whole_ms > 0:
                        if self.worker.arm():
                            self._select(whole_ms - 1e-6)  # epoll rounds up: stay below
                        continue
                    self._pause(time.sleep, timeout)
                    self._select(0)
                    continue
                if timeout > 0 and not self.worker.arm():
                    timeout = 0.0
                self._select(timeout)
        except BaseException as exc:
            log.exception("lynx I/O thread crashed")
            self.on_crash(exc)
        finally:
            self._stopping = True
            try:
                self.shutdown()
            finally:
                if self.heartbeats is not None:
                    self.heartbeats.stop()
                with self._calls_lock:
                    calls, self._calls = list(self._calls), collections.deque()
                for fn, fut in calls:
                    self._run_one(fn, fut)
                # UCX objects die on the thread that used them, requests first
                self.release_ucx()
                self.worker.close()
                self.selector.close()
                self._wake_r.close()
                self._wake_w.close()
                self._owner.release()
