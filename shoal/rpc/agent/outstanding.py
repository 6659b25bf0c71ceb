"""The calls this worker waits on (each with its deadline and callee), and the other work a graceful
shutdown must wait for: callbacks of completed futures, which may make RPCs of their own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shoal.rpc.agent.deadlines import Deadlines
from shoal.rpc.future import Future


@dataclass
class Call:
    future: Future
    dst: int
    what: str
    timeout: float


class Outstanding:
    """Calls in flight by message id. A call ends once: answered, expired, failed with its callee,
    or failed at shutdown; whichever comes first completes its future."""

    def __init__(self, name: str, worker_name: Callable[[int], str]) -> None:
        self._name = name
        self._worker_name = worker_name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._calls: dict[int, Call] = {}
        # Work besides calls: counted from submission, so we never look idle in between.
        self._busy = 0
        self._closed = False
        self._deadlines = Deadlines(self._expire, lambda key: key in self._calls, f"shoal-rpc-deadlines-{name}")

    def add(self, msg_id: int, call: Call) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RPC was shut down on worker {self._name!r}")
            self._calls[msg_id] = call
        self._deadlines.add(time.monotonic() + call.timeout, msg_id)

    def get(self, msg_id: int) -> Call | None:
        return self._calls.get(msg_id)

    def finish(self, msg_id: int, value: Any, error: BaseException | None) -> None:
        with self._lock:
            call = self._calls.pop(msg_id, None)
            if call is None:
                return
            self._busy += 1  # until its callbacks are counted themselves: we must not look idle between
        try:
            call.future._complete(value, error)
        finally:
            self.work_done()

    def fail_calls_to(self, rank: int, error: BaseException) -> None:
        with self._lock:
            failed = [msg_id for msg_id, call in self._calls.items() if call.dst == rank]
        for msg_id in failed:
            self.finish(msg_id, None, error)

    def work_started(self) -> None:
        with self._lock:
            self._busy += 1

    def work_done(self) -> None:
        with self._lock:
            self._busy -= 1
            if self._is_idle():
                self._idle.notify_all()

    def wait_idle(self, deadline: float) -> None:
        """Until no call is in flight and no callback is running; TimeoutError at the deadline."""
        with self._lock:
            if not self._idle.wait_for(self._is_idle, max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"worker {self._name!r}: {len(self._calls)} RPCs and {self._busy} "
                                   f"callbacks still outstanding at the shutdown deadline")

    def close(self) -> None:
        """Refuse new calls and fail those in flight."""
        with self._lock:
            self._closed = True
            calls, self._calls = self._calls, {}
        for call in calls.values():
            call.future._complete(None, RuntimeError(f"RPC was shut down on worker {self._name!r} before "
                                                     f"{call.what} completed"))
        self._deadlines.stop()

    def _is_idle(self) -> bool:
        return not self._calls and not self._busy

    def _expire(self, msg_id: int) -> None:
        call = self._calls.get(msg_id)
        if call is not None:
            self.finish(msg_id, None, TimeoutError(
                f"RPC {call.what} to worker {self._worker_name(call.dst)!r} did not complete within "
                f"{call.timeout:g}s"))
