"""Notices that ride on the next message to their worker (`RpcAgent.notify_soon`).

Bookkeeping that nobody waits for, such as the release of a distributed autograd context, would
cost a message of its own: a write and a frame on the sender, a wake-up, reads and a dispatch on the
receiver, all on two busy processes. Most such notices go to a worker that the same program calls
again moments later (the next training step), so they wait for that call and travel in its header.
One that finds nothing to ride on within `WAIT_S` goes alone, from a thread of its own.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from shoal.rpc.headers import Rider

log = logging.getLogger(__name__)

WAIT_S = 0.02  # how long a notice waits for a message to ride on


class _Waiting(NamedTuple):
    """One destination's notices, and when they go alone: `WAIT_S` after the first of them came."""

    due: float
    riders: list[Rider]


class Riders:
    """Notices waiting, per destination rank; `send_alone(dst, riders)` sends those that waited
    `WAIT_S` in a message of their own. Each notice goes exactly once; no order is promised (a
    message that took some may reach the wire after one that took later ones).

    The thread sleeps until the first waiting notice is due, and a new notice wakes it only if it is
    due sooner than that. In a training loop, where each step's notices ride on the next step's
    calls, it wakes about once a step, not at every notice: each wake-up takes the GIL from a
    process whose next call is on its way. A destination's notices go alone `WAIT_S` after the first
    of them still waiting came: one that came earlier and rode no longer counts."""

    def __init__(self, send_alone: Callable[[int, tuple[Rider, ...]], None], name: str) -> None:
        self._send_alone = send_alone
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting: dict[int, _Waiting] = {}
        self._wakes_at = math.inf  # when the sleeping thread looks next, unless woken sooner
        self._flushes: list[threading.Event] = []  # each set once everything waiting then is sent
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, dst: int, rider: Rider) -> None:
        with self._lock:
            waiting = self._waiting.get(dst)
            if waiting is not None:
                waiting.riders.append(rider)
                return
            due = time.monotonic() + WAIT_S
            self._waiting[dst] = _Waiting(due, [rider])
            if due < self._wakes_at:
                self._wakes_at = due
                self._changed.notify()

    def take(self, dst: int) -> tuple[Rider, ...]:
        """The notices waiting for `dst`, for the message about to go there."""
        if not self._waiting:  # most messages: nothing waits, and no lock is needed to see that
            return ()
        with self._lock:
            waiting = self._waiting.pop(dst, None)
        return () if waiting is None else tuple(waiting.riders)

    def drop(self, dst: int) -> None:
        """`dst` is gone: what waited for it goes nowhere."""
        with self._lock:
            self._waiting.pop(dst, None)

    def flush(self, timeout: float) -> bool:
        """Send everything waiting now, each destination's notices alone; wait until they are sent."""
        flushed = threading.Event()
        with self._lock:
            self._flushes.append(flushed)
            self._changed.notify()
        return flushed.wait(timeout)

    def stop(self, timeout: float) -> None:
        """Send what still waits (a release passed on during shutdown, say), then end the thread."""
        with self._lock:
            self._stopping = True
            self._changed.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                due, flushes, stopping = self._wait_for_work()
            for dst, riders in due:
                self._send(dst, riders)
            for flushed in flushes:
                flushed.set()
            if stopping:
                return

    def _wait_for_work(self) -> tuple[list[tuple[int, tuple[Rider, ...]]], list[threading.Event], bool]:
        """Sleep (the lock held, but for the sleep) until notices are due, a flush is asked for or the
        thread is to stop; take what is due (everything, for a flush or a stop)."""
        while True:
            now = time.monotonic()
            everything = self._stopping or bool(self._flushes)
            due = [dst for dst, waiting in self._waiting.items() if everything or waiting.due <= now]
            if due or everything:
                flushes, self._flushes = self._flushes, []
                return [(dst, tuple(self._waiting.pop(dst).riders)) for dst in due], flushes, self._stopping
            self._wakes_at = min((waiting.due for waiting in self._waiting.values()), default=math.inf)
            self._changed.wait(None if self._wakes_at == math.inf else self._wakes_at - now)

    def _send(self, dst: int, riders: tuple[Rider, ...]) -> None:
        try:
            self._send_alone(dst, riders)
        except Exception as exc:  # the worker is gone, and whatever the notices were about with it
            log.debug("notices for rank %d could not be sent: %s", dst, exc)
