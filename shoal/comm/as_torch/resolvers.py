"""Threads that complete torch futures for a group's operations, away from the group's own queue.

torch runs a future's callbacks inside `set_result`, on the thread that calls it. A callback may start
another operation of the same group and wait for it: torch's PowerSGD hook does, in every bucket. Were the
group's queue to complete the future, it would wait there for an operation that only it can run. So a job
here never waits behind another: when no resolver thread is idle, a new one starts. There are as many as
jobs have run at once; one idle for a minute ends.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_IDLE_S = 60.0


class Resolvers:
    """Runs each job on a thread of its own among those that are not busy."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every thread (a forked child has none of its parent's)."""
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._idle = 0  # threads waiting for a job that no one has handed them yet
        self._handed = 0  # jobs handed to idle threads that they have not yet taken
        self._names = itertools.count()

    def run(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._idle:
                self._idle -= 1
                self._handed += 1
                self._cond.notify()
                return
        try:
            threading.Thread(target=self._serve, name=f"shoal-futures-{next(self._names)}", daemon=True).start()
        except RuntimeError:  # no thread to be had (the interpreter is ending): run it here rather than never
            with self._cond:
                job = self._jobs.popleft()
            log.warning("no thread to complete a torch future on: completing it on the thread that finished its op")
            job()

    def _serve(self) -> None:
        while True:
            with self._cond:
                job = self._jobs.popleft()  # one job was queued for each thread started or woken
            try:
                job()
            except Exception:
                log.exception("completing a torch future raised")
            del job  # the future and what its callbacks hold are not kept while this thread idles
            with self._cond:
                self._idle += 1
                if not self._cond.wait_for(lambda: self._handed, timeout=_IDLE_S):
                    self._idle -= 1
                    return
                self._handed -= 1


resolvers = Resolvers()
os.register_at_fork(after_in_child=resolvers.reset)
