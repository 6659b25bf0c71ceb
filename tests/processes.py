"""Processes a test starts: whatever happens in the test, none outlives it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def reaped(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """Kills (and waits for) every process in `procs` still running when the block ends; the test may
    append to the list inside the block."""
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
