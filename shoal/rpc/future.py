"""The result of an asynchronous RPC: wait for it, ask whether it is done, or chain work onto it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
S = TypeVar("S")
_SLICE_S = 1.0  # how long a waiter sleeps on the latch before it looks at `done` again


def _raise(error: BaseException) -> None:
    raise error


class Future(torch.futures.Future[T]):
    """A value that arrives later, with torch.futures.Future's methods (`wait`, `then`, `done`,
    `value`, `add_done_callback`); it is a torch.futures.Future, so `torch.futures.wait_all` and
    `collect_all` take it.

    Callbacks run on the thread that completes the future, or right away if it is already done.
    A future completed by a connection's reader thread hands its callbacks to the RPC thread pool
    (see `RpcAgent`), so a callback may block or make RPCs of its own.
    """

    def __init__(self, *, run_callback: Callable[[Callable[[], None]], None] | None = None) -> None:
        super().__init__()
        self._done = False
        # Held until the future completes; a waiter takes it and hands it straight back, so every
        # waiter gets through. A bare lock, where an Event would cost a Condition per future and a
        # waiter lock per wait.
        self._latch = threading.Lock()
        self._latch.acquire()
        self._lock = threading.Lock()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], None]] = []
        self._run_callback = run_callback

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> T:
        """The value, once it is there; re-raises the call's error. `timeout` (seconds) bounds this
        wait only: an RPC future always completes by its call's own deadline."""
        if not self._done:
            self._await_done(timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def _await_done(self, timeout: float | None) -> None:
        """Sleep on the latch until the future is done, in slices: a waiter interrupted while it holds
        the latch, or a completer interrupted before releasing it, must not keep the others asleep once
        `done` is true."""
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while not self._done:
            left = _SLICE_S if end is None else min(_SLICE_S, end - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"the future did not complete within {timeout:g}s")
            if self._latch.acquire(timeout=left):
                self._latch.release()
                return

    def value(self) -> T:
        """The value of a completed future (raising its error); ValueError if it is not done yet."""
        if not self.done():
            raise ValueError("the future is not done yet; call wait() instead")
        return self.wait()

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None

    def then(self, callback: Callable[[Future[T]], S]) -> Future[S]:
        """A future of `callback(self)`, run once this one completes; an exception the callback
        raises completes the new future with that exception."""
        chained: Future[S] = Future(run_callback=self._run_callback)

        def run(done: Future[T]) -> None:
            try:
                chained.set_result(callback(done))
            except BaseException as exc:
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained

    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def set_result(self, value: T) -> None:
        if not self._complete(value, None):
            raise RuntimeError("this future is already completed")

    def set_exception(self, error: BaseException) -> None:
        if not self._complete(None, error):
            raise RuntimeError("this future is already completed")

    def _complete(self, value: Any, error: BaseException | None) -> bool:
        """Complete once; later attempts (a late response after a timeout) are ignored."""
        with self._lock:
            if self._done:
                return False
            self._value, self._error = value, error
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        self._latch.release()
        # Out of the lock and after `done`: callbacks registered through torch's own functions
        # (collect_all, its then) run in here, on this thread, and may look at this future. As
        # for any torch future, they must not block: it may be a connection's reader thread.
        self._complete_torch_side()
        for callback in callbacks:
            if self._run_callback is not None:
                self._run_callback(lambda cb=callback: cb(self))
            else:
                callback(self)
        return True

    def _complete_torch_side(self) -> None:
        """The C++ future's value, for torch.futures' functions, which wait on it rather than on us."""
        if self._error is not None:
            torch._C.Future._set_unwrap_func(self, _raise)
            torch._C.Future.set_result(self, self._error)
        else:
            torch._C.Future.set_result(self, self._value)
