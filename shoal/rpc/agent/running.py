"""How the agent runs work on its pool: requested functions (served calls, notices, the objects of
remote() calls) in their caller's autograd context, and the callbacks of its futures, counted as
work a graceful shutdown waits for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.observe import events
from shoal.rpc import autograd_contexts
from shoal.rpc.agent.outstanding import Outstanding
from shoal.rpc.agent.pool import WorkerPool
from shoal.rpc.functions import is_async_execution
from shoal.rpc.future import Future
from shoal.rpc.headers import AutogradTag, FunctionRef
from shoal.rpc.message import resolve_function
from shoal.rpc.rref_context import Owned

Settle = Callable[[Any, "BaseException | None"], None]


def outcome(done: torch.futures.Future) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, error) of a completed future, ours or any torch.futures.Future."""
    try:
        return done.value(), None
    except BaseException as exc:
        return None, exc


class Runner:
    """Runs the agent's work on `pool`; `outstanding` counts the callbacks among it."""

    def __init__(self, name: str, *, pool: WorkerPool, outstanding: Outstanding) -> None:
        self._name = name
        self._pool = pool
        self._outstanding = outstanding

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the pool, or here once the pool is shut down."""
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: nothing else will run it
            fn(*args)

    def run_callback(self, callback: Callable[[], None]) -> None:
        """Run a future's callback on the pool, counted as outstanding work until it returns."""
        self._outstanding.work_started()
        self.submit(self._run_counted, callback)

    def _run_counted(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        finally:
            self._outstanding.work_done()

    def on_a_pool_thread(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn` here if this is one of our pool's threads, else hand it to the pool: a future may
        complete on any thread, a connection's reader included, where nothing may block."""
        if self._pool.on_own_thread():
            fn(*args)
        else:
            self.submit(fn, *args)

    def run_function(self, ref: FunctionRef, args: tuple, kwargs: dict, tag: AutogradTag | None,
                     settle: Settle) -> None:
        """Run a requested function in its caller's autograd context; `settle(value, error)` gets
        the outcome at once or, for an @async_execution function, once its future completes."""
        try:
            func = resolve_function(ref, self._name)
            started = events.begin()
            try:
                if tag is None:  # most calls: no context to enter (and a `with` would cost calls)
                    result = func(*args, **kwargs)
                else:
                    with autograd_contexts.serving(tag):
                        result = func(*args, **kwargs)
            finally:
                if started is not None:
                    events.complete(f"serve {ref[0]}.{ref[1]}", events.COMPUTE, started)
            answers_later = is_async_execution(func)
            if answers_later and not isinstance(result, torch._C.Future):  # then()'s futures are only that
                raise TypeError(f"{ref[0]}.{ref[1]} is an @async_execution function, so it must return a future, "
                                f"not {type(result).__name__}")
        except BaseException as exc:  # SystemExit too: the caller must hear of it, not time out
            settle(None, exc)
            return
        if answers_later:
            result.add_done_callback(lambda done: self.on_a_pool_thread(settle, *outcome(done)))
        else:
            settle(result, None)

    def create(self, entry: Owned, ref: FunctionRef, args: tuple, kwargs: dict, tag: AutogradTag | None,
               created: Future[None]) -> None:
        """Compute the object of a remote() call into its entry; `created` reports how that went."""
        def settle(value: Any, error: BaseException | None) -> None:
            entry.value._complete(value, error)
            created._complete(None, error)

        self.run_function(ref, args, kwargs, tag, settle)
