"""`@async_execution`: a remote function that answers later. It returns a future at once and the
callee answers the caller when that future completes, so a call that waits on other calls (a
parameter server batching updates from several trainers) holds no thread while it waits.

`@runs_on_reader`, for shoal's own notices: the receiver runs them where they arrive."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_shoal_async_execution"
_READER_MARK = "_shoal_runs_on_reader"


def async_execution(fn: F) -> F:
    """Mark `fn` as answering through the future it returns (a `shoal.rpc.Future` or any
    `torch.futures.Future`); the caller sees that future's value or exception."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: Callable[..., Any]) -> bool:
    return getattr(fn, _MARK, False)


def runs_on_reader(fn: F) -> F:
    """Mark a notice's function as quick and never blocking: the receiver runs it on the
    connection's reader thread as it arrives, one thread hand-off sooner than on its pool (a
    backward's completion reaches the thread waiting for it that much earlier)."""
    setattr(fn, _READER_MARK, True)
    return fn


def is_run_on_reader(fn: Callable[..., Any]) -> bool:
    return getattr(fn, _READER_MARK, False)
