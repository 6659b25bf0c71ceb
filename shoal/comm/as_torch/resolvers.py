"""Threads that complete torch futures for a group's operations, away from the group's own queue.

torch runs a future's callbacks inside `set_result`, on the thread that calls it. A callback may start
another operation of the same group and wait for it: torch's PowerSGD hook does, in every bucket. Were the
group's queue to complete the future, it would wait there for an operation that only it can run. So a job
here never waits behind another: when no resolver thread is idle, a new one starts. Their number is the
deepest nesting of such waits seen, a handful; idle ones wait for the next job.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Resolvers:
    """Runs each job on a thread of its own among those that are not busy."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # the parent's threads are not in the child

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._idle = 0  # threads waiting for a job that no one has handed them yet
        self._handed = 0  # jobs handed to idle threads that they have not yet taken

    def run(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            if self._idle:
                self._idle -= 1
                self._handed += 1
                self._cond.notify()
                return
        threading.Thread(target=self._serve, name="shoal-futures", daemon=True).start()

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
                self._cond.wait_for(lambda: self._handed)
                self._handed -= 1


resolvers = Resolvers()
