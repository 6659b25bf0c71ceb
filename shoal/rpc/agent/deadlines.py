"""One thread that fails calls whose deadline passes, so a future completes even if nobody waits on it."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable


class Deadlines:
    """Calls `expire(key)` for each key whose deadline has passed; `expire` ignores keys that
    finished in time, which stay in the heap until then or until a compaction drops them."""

    def __init__(self, expire: Callable[[int], None], is_live: Callable[[int], bool], name: str) -> None:
        self._expire = expire
        self._is_live = is_live
        self._heap: list[tuple[float, int]] = []
        self._compacted_size = 0
        self._lock = threading.Lock()  # taken bare where nothing waits: a Condition's `with` runs Python code
        self._cond = threading.Condition(self._lock)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, deadline: float, key: int) -> None:
        with self._lock:
            if len(self._heap) >= 2 * self._compacted_size + 1024:
                # Completed calls pile up until their deadlines: drop them now and then, so a long
                # stream of fast calls does not grow the heap without bound.
                self._heap = [item for item in self._heap if self._is_live(item[1])]
                heapq.heapify(self._heap)
                self._compacted_size = len(self._heap)
            heapq.heappush(self._heap, (deadline, key))
            if self._heap[0][1] == key:  # the new earliest deadline: the thread must wake sooner
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                _, key = heapq.heappop(self._heap)
            self._expire(key)
