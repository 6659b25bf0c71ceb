"""torch.distributed's Work over a shoal Work: what torch's callers (DDP's reducer, FSDP2, functional
collectives) wait on, with shoal's failures raised as torch's DistBackendError."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch.futures import Future

from shoal.comm.as_torch.resolvers import resolvers
from shoal.comm.backends.work import Work


def backend_error(error: BaseException) -> tdist.DistBackendError:
    """`error` as torch's users catch a backend's failure: a DistBackendError with shoal's message (which
    names the lost rank, the mismatched calls or the deadline), the original chained as its cause."""
    if isinstance(error, tdist.DistBackendError):
        return error
    translated = tdist.DistBackendError(f"{type(error).__name__}: {error}")
    translated.__cause__ = error
    return translated


class TorchWork(tdist.Work):
    """One operation of a shoal group, as torch's Work: `result` is what the op leaves its output in,
    the value of `get_future()` (DDP's communication hooks read the reduced bucket there).

    `then` finishes the op where torch's meaning asks more than shoal's did (PREMUL_SUM's scaling): it runs
    once shoal's op is done, on the thread that finished it, so before the group's next op begins. The
    futures complete after it, on resolver threads (resolvers.py), and the Work counts as done, for `wait`,
    only after they have, as gloo's does."""

    def __init__(self, work: Work, result: list[torch.Tensor], then: Callable[[], None] | None = None, *,
                 source: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._work = work
        self._source = source  # a receive from any source: the group rank it took its message from
        self._result = result
        self._then = then
        self._settling = threading.Lock()
        self._known = False  # the outcome is in `_error`: a future asked for now completes at once
        self._settled = threading.Event()
        self._error: BaseException | None = None
        self._futures: list[Future] = []
        work.add_done_callback(self._settle)

    def _settle(self, error: BaseException | None) -> None:
        if error is None and self._then is not None:
            try:
                self._then()
            except Exception as exc:
                error = exc
        with self._settling:
            self._error = None if error is None else backend_error(error)
            self._known = True
            futures, self._futures = self._futures, []
        if futures:
            resolvers.run(lambda: self._complete(futures))  # not on this thread, the group's queue
        else:
            self._settled.set()

    def _complete(self, futures: list[Future]) -> None:
        try:
            for future in futures:
                self._resolve(future)
        finally:
            self._settled.set()

    def _resolve(self, future: Future) -> None:
        if self._error is None:
            future.set_result(self._result)
        else:
            future.set_exception(self._error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        # torch passes a zero timeout (its kNoTimeout) when the caller gave none: then the group's applies.
        try:
            self._work.wait(timeout if timeout else None)
        except Exception as exc:
            raise backend_error(exc) from exc
        self._settled.wait()  # shoal's op is done: only its `then` and its futures' callbacks may be left
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._settled.is_set()

    def _source_rank(self) -> int:
        """What torch's `recv(src=None)` returns: the group rank of the sender, once waited for."""
        if self._source is None:
            raise ValueError("sourceRank() may only be called on work objects that correspond to a recv from "
                             "any source")
        return self._source()

    def is_success(self) -> bool:
        return self._settled.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Nothing to order against: shoal's results land in host memory before the op completes."""

    def get_future(self) -> Future:
        future: Future = Future()
        with self._settling:
            if not self._known:
                self._futures.append(future)
                return future
        self._resolve(future)
        return future
