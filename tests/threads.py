"""How often a thread went to sleep: each later wake-up of a sleeping thread is a context switch and
a GIL hand-off, which code on a hot path should not cause for nothing."""

from __future__ import annotations

import sys
import threading

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="counts a thread's sleeps in /proc (Linux only)")


def voluntary_switches(thread: threading.Thread) -> int:
    """How many times `thread` has slept so far (Linux's count of its voluntary context switches)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"/proc has no count of voluntary context switches for thread {thread.name!r}")


def named(name: str) -> threading.Thread:
    """The one running thread called `name`."""
    found = [t for t in threading.enumerate() if t.name == name]
    assert len(found) == 1, f"{len(found)} running threads are called {name!r}"
    return found[0]
