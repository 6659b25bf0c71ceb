"""Notices that ride on the next message to their worker (`RpcAgent.notify_soon`).

Bookkeeping that nobody waits for, such as the release of a distributed autograd context, would
cost a message of its own: a write and a frame on the sender, a wake-up, reads and a dispatch on the
receiver, all on two busy processes. Most such notices go to a worker that the same program calls
again moments later (the next training step), so they wait for that call and travel in its header.
One that finds nothing to ride on within `WAIT_S` goes alone, from a thread of its own.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

from shoal.rpc.headers import Rider

log = logging.getLogger(__name__)

WAIT_S = 0.02  # how long a notice waits for a message to ride on


class Riders:
    """Notices waiting, per destination rank; `send_alone(dst, riders)` sends those that waited
    `WAIT_S` in a message of their own. Each notice goes exactly once; no order is promised (a
    message that took some may reach the wire after one that took later ones)."""

    def __init__(self, send_alone: Callable[[int, tuple[Rider, ...]], None], name: str) -> None:
        self._send_alone = send_alone
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Rider]] = {}
        # (when, destination) for each destination's first waiting notice, in order of `when`; an
        # Event asks for everything at once (shutdown), None ends the thread.
        self._due: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, dst: int, rider: Rider) -> None:
        with self._lock:
            waiting = self._waiting.setdefault(dst, [])
            waiting.append(rider)
            first = len(waiting) == 1
        if first:
            self._due.put((time.monotonic() + WAIT_S, dst))

    def take(self, dst: int) -> tuple[Rider, ...]:
        """The notices waiting for `dst`, for the message about to go there."""
        if not self._waiting:  # most messages: nothing waits, and no lock is needed to see that
            return ()
        with self._lock:
            return tuple(self._waiting.pop(dst, ()))

    def drop(self, dst: int) -> None:
        """`dst` is gone: what waited for it goes nowhere."""
        with self._lock:
            self._waiting.pop(dst, None)

    def flush(self, timeout: float) -> bool:
        """Send everything waiting now, each destination's notices alone; wait until they are sent."""
        flushed = threading.Event()
        self._due.put(flushed)
        return flushed.wait(timeout)

    def stop(self, timeout: float) -> None:
        """Send what still waits (a release passed on during shutdown, say), then end the thread."""
        self._due.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        due: collections.deque[tuple[float, int]] = collections.deque()  # in order of time
        while True:
            now = time.monotonic()
            while due and due[0][0] <= now:
                self._send(due.popleft()[1])
            try:
                item = self._due.get(timeout=due[0][0] - now if due else None)
            except queue.Empty:
                continue
            if item is None:
                self._send_all()
                return
            if isinstance(item, threading.Event):
                self._send_all()
                item.set()
            else:
                due.append(item)

    def _send_all(self) -> None:
        with self._lock:
            destinations = list(self._waiting)
        for dst in destinations:
            self._send(dst)

    def _send(self, dst: int) -> None:
        riders = self.take(dst)
        if not riders:  # they rode on a message meanwhile
            return
        try:
            self._send_alone(dst, riders)
        except Exception as exc:  # the worker is gone, and whatever the notices were about with it
            log.debug("notices for rank %d could not be sent: %s", dst, exc)
