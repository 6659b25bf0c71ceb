"""Waiting in tests for what another thread or process brings about: poll a condition, with a deadline.

    wait_until(lambda: rpc.rpc_sync("w1", live_counters) == 0, "w1 has freed the object", timeout=20)

Every wait in the tests goes through `wait_until`, so none can hang and each failure says what never happened.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, *, timeout: float = 20.0, interval: float = 0.01) -> T:
    """Call `condition` every `interval` seconds until it returns something true, and return that.

    Raises TimeoutError naming `what` (a clause: "rank 2 is found lost") and `timeout` once `timeout`
    seconds pass without it. An exception from `condition` ends the wait: a test that must also watch its
    child processes meanwhile raises from the condition when one ends, or returns true to stop waiting.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(interval)  # a poll: what we wait for gives no signal of its own
    return value


def process_gone(pid: int) -> bool:
    """Whether process `pid` has ended; one that has exited but is not yet reaped (a zombie) counts as gone."""
    if not os.path.isdir("/proc/self"):  # not Linux: only whether the pid is still taken can be asked
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
