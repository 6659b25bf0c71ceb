"""RRef deletions, queued from `__del__` and sent a little later from a thread of their own."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Releaser:
    """`__del__` may run on any thread at any moment (inside a lock, on a connection's reader), so
    it must not send anything itself: it queues the deletion here, and this thread sends it."""

    def __init__(self, send: Callable[[tuple], None], name: str) -> None:
        self._send = send
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._queue.put(item)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far has been sent."""
        flushed = threading.Event()
        self._queue.put(flushed)
        return flushed.wait(timeout)

    def stop(self, timeout: float) -> None:
        """Send what is queued (each send is bounded by the transport), then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._send(item)
            except Exception as exc:  # the worker is gone, and its objects and contexts with it
                log.debug("a deferred message could not be sent: %s", exc)
