"""The threads that run an agent's served calls and callbacks (and, one thread of it, the
passes of distributed backwards on this worker).

Each item is a plain function call: the agent answers through messages of its own, so it needs none
of the per-item futures, condition variables and semaphores of concurrent.futures' pool, whose
bookkeeping cost as much as a fast call. And the thread that went idle last takes the next call:
its caches are warm, and so is its malloc arena. A parameter server whose every step makes and
frees a 25 MB gradient reuses that memory when one thread keeps making it; handed round the threads,
each thread's arena had to fault in fresh pages for it (a 2 ms pass took 10 ms one step in five).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_running_on = threading.local()  # the pool whose thread this is, if any


class WorkerPool:
    """Runs submitted calls, in order of submission, on up to `max_threads` threads, started as
    calls find none idle."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._max_threads = max_threads
        self._name = name
        self._lock = threading.Lock()
        self._calls: collections.deque[tuple[Callable[..., Any], tuple]] = collections.deque()
        self._idle: list[threading.Lock] = []  # each idle thread's wake-up, the latest to go idle last
        self._threads: list[threading.Thread] = []
        self._shut = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on a thread of the pool; RuntimeError once the pool is shut down."""
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: the pool is shut down")
            self._calls.append((fn, args))
            if self._idle:
                self._idle.pop().release()
            elif len(self._threads) < self._max_threads:
                thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # the system has no thread to give: those there are will serve it
                    if not self._threads:
                        self._calls.pop()
                        raise
                else:
                    self._threads.append(thread)

    def on_own_thread(self) -> bool:
        return getattr(_running_on, "pool", None) is self

    def shutdown(self) -> None:
        """Refuse new calls; the threads finish those already queued, then end."""
        with self._lock:
            self._shut = True
            idle, self._idle = self._idle, []
        for wake in idle:
            wake.release()

    def join(self, deadline: float) -> None:
        """Wait, until the monotonic `deadline` at most, for the threads to end (after `shutdown`)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        _running_on.pool = self
        wake = threading.Lock()
        wake.acquire()  # held while working: released to wake this thread when idle
        while True:
            with self._lock:
                if self._calls:
                    fn, args = self._calls.popleft()
                elif self._shut:
                    return
                else:
                    self._idle.append(wake)
                    fn = None
            if fn is None:
                # Idle: woken for a call (which a thread finishing its own may take first) or at shutdown.
                wake.acquire()
                continue
            try:
                fn(*args)
            except BaseException:  # the call's own error handling failed: say so, and keep serving
                log.exception("%s: a call on the pool raised", self._name)
            del fn, args  # not kept alive while idle
