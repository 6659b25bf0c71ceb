"""`@async_execution`: a remote function that answers later. It returns a future at once and the
callee answers the caller when that future completes, so a call that waits on other calls (a
parameter server batching updates from several trainers) holds no thread while it waits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_shoal_async_execution"


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
