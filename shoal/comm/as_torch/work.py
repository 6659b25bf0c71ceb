"""torch.distributed's Work over a shoal Work: what torch's callers (DDP's reducer, FSDP2, functional
collectives) wait on, with shoal's failures raised as torch's DistBackendError."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch.futures import Future

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
    the value of `get_future()` (DDP's communication hooks read the reduced bucket there)."""

    def __init__(self, work: Work, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._work = work
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        # torch passes a zero timeout (its kNoTimeout) when the caller gave none: then the group's applies.
        try:
            return self._work.wait(timeout if timeout else None)
        except Exception as exc:
            raise backend_error(exc) from exc

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        error = self._work.exception()
        return None if error is None else backend_error(error)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Nothing to order against: shoal's results land in host memory before the op completes."""

    def get_future(self) -> Future:
        future: Future = Future()

        def settle(error: BaseException | None) -> None:
            if error is None:
                future.set_result(self._result)
            else:
                future.set_exception(backend_error(error))

        self._work.add_done_callback(settle)
        return future


class AllOf(Work):
    """Several shoal operations as one (torch's coalesced collectives): done when all are, failed with
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
