"""Work handles for asynchronous operations, and the queue that runs a group's operations in issue order."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from shoal.observe import events
from shoal.observe.flight import Entry, recorder

log = logging.getLogger(__name__)


class Work:
    """Handle of an operation started with `async_op=True` (same methods as torch's Work).

    The backend may give it the operation's flight-recorder entry and, once the operation runs, the
    start of its span on the timeline: both are closed when it finishes.
    """

    def __init__(self, name: str, timeout: timedelta) -> None:
        self.name = name
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout.total_seconds()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._claim = threading.Lock()
        self._finished = False
        self.flight: Entry | None = None
        self._started: events.Started | None = None
        self._span_args: dict[str, Any] = {}
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        self._label = events.comm_label.get()  # what an enclosing `record_comm` calls it
        self._source: int | None = None  # the sender a receive from any source took its message from

    def running(self, span_args: dict[str, Any]) -> events.Started | None:
        """The operation has started to run: its flight entry says so and its span begins, described by
        `span_args` (which the backend may still add to)."""
        if self._finished:
            return None
        if self.flight is not None:
            self.flight.start()
        self._started = events.begin()
        self._span_args = span_args
        if self._label is not None:
            span_args["label"] = self._label
        return self._started

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation is done; re-raise its error. Returns True, as torch's does."""
        limit = self._deadline - time.monotonic() if timeout is None else timeout.total_seconds()
        if not self._event.wait(max(0.0, limit)):
            seconds = self._timeout.total_seconds() if timeout is None else timeout.total_seconds()
            recorder.dump(f"{self.name} timed out after {seconds:g}s")
            raise TimeoutError(f"{self.name} did not complete within {seconds:g}s")
        if self._error is not None:
            raise self._error
        return True

    @property
    def deadline(self) -> float:
        """`time.monotonic()` value after which waiting for this op raises TimeoutError."""
        return self._deadline

    def source_rank(self) -> int:
        """The global rank whose message a receive from any source (`src=None`) took, once it is done."""
        if self._source is None or not self._event.is_set():
            raise ValueError(f"{self.name}: the sender is known only for a receive from any source, once done")
        return self._source

    def received_from(self, rank: int) -> None:
        """Record the sender of a receive from any source (by the backend, before `finish`)."""
        self._source = rank

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call `callback(error)` once the operation is done (at once, here, if it is), on the thread that
        finishes it: the group's queue, or for a send or receive the transport's (a connection's reader or
        send thread) or the sending thread itself (a small send written at once). So it must be short and
        must not wait for another operation; what it raises is logged, and does not reach the group."""
        with self._claim:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self._error)

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the operation done (by the backend); the first outcome wins."""
        with self._claim:
            if self._finished:
                return
            self._finished = True
        try:
            if self.flight is not None:
                self.flight.finish(error)
            if self._started is not None:
                if error is not None:
                    self._span_args["error"] = repr(error)
                events.complete(self.name, events.COMM, self._started, **self._span_args)
        finally:  # whatever observing it did, the operation is done
            self._error = error
            self._event.set()
            with self._claim:
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                try:
                    callback(error)
                except Exception:
                    log.exception("a done-callback of %s raised", self.name)
        if isinstance(error, TimeoutError):
            recorder.dump(f"{self.name}: {error}")


class AllOf(Work):
    """Several shoal operations as one (coalesced collectives): done when all are, failed with
    the first error."""

    def __init__(self, name: str, parts: list[Work], timeout: timedelta) -> None:
        super().__init__(name, timeout)
        self._counting = threading.Lock()
        self._left = len(parts)
        self._errors: list[BaseException] = []
        if not parts:
            self.finish()
        for part in parts:
            part.add_done_callback(self._one_done)

    def _one_done(self, error: BaseException | None) -> None:
        with self._counting:
            self._left -= 1
            if error is not None:
                self._errors.append(error)
            done = self._left == 0
        if done:
            self.finish(self._errors[0] if self._errors else None)


class OpQueue:
    """Runs callables one at a time in the order they were submitted, on a background thread.

    A blocking call that finds the queue idle runs on the caller's thread instead (`submit` says
    so, `run_here` runs it), which saves two thread hand-offs on the latency-critical path and keeps
    the order all the same.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: deque[Callable[[], None]] = deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None], *, inline_if_idle: bool = False) -> bool:
        """Queue `job`; or, with `inline_if_idle` and nothing queued or running, reserve the queue
        and return True: the caller must then call `run_here(job)` (outside any lock of its own)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name} is shut down")
            if inline_if_idle and not self._busy and not self._pending:
                self._busy = True
                return True
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return False

    def run_here(self, job: Callable[[], None]) -> None:
        """Run a job the queue is reserved for, then release the queue."""
        try:
            job()
        finally:
            with self._cond:
                self._busy = False
                if self._pending or self._closed:  # else nobody waits for this: the loop would wake for nothing
                    self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: (self._pending and not self._busy) or (self._closed and not self._pending))
                if not self._pending:
                    return  # closed and drained
                job = self._pending.popleft()
                self._busy = True
            self.run_here(job)

    def close(self, timeout: timedelta) -> None:
        """Let queued jobs finish (up to `timeout`), then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            drained = self._cond.wait_for(lambda: not self._pending and not self._busy,
                                          timeout=timeout.total_seconds())
        if drained and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout.total_seconds())  # it has nothing left to do but return
