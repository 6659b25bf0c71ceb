"""Flight records at the end of a traced job: before `shoal run --trace DIR` stops its workers, it asks
each one for what it was doing, so that `shoal trace hang` can tell which was behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from shoal.elastic.worker import Worker
from shoal.observe.flight import FILE_PREFIX

_FLIGHT_DUMP_S = 3.0  # with --trace, how long workers get to write their flight records before SIGTERM


def collect_flight_records(workers: list[Worker], trace: Path) -> None:
    """Workers about to be stopped write what they were doing (SIGUSR1, shoal.observe.flight) into
    `trace`, the trace directory, first, so that `shoal trace hang` can tell which was behind."""
    asked = [w for w in workers if _catches(w.proc.pid, signal.SIGUSR1)]  # else SIGUSR1 would kill it
    for worker in asked:  # the worker alone: processes it started may not handle SIGUSR1
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.proc.pid, signal.SIGUSR1)
    expected = [trace / f"{FILE_PREFIX}rank{w.rank}-pid{w.proc.pid}.json" for w in asked]
    deadline = time.monotonic() + _FLIGHT_DUMP_S
    while time.monotonic() < deadline and not all(path.exists() for path in expected):
        time.sleep(0.05)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux's /proc says; elsewhere: assume not). A
    worker that has not joined its job yet (the handler comes with init_process_group, or with tracing) would
    die of SIGUSR1's default action."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line.split()[1] for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signum - 1) & 1)
