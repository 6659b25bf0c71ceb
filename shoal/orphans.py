"""Processes we start die with the process that started them, so a killed parent leaves no orphans."""

from __future__ import annotations

import ctypes
import os
import signal

try:  # looked up at import, not in a forked child, where loading a library could deadlock
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None  # not Linux: the parent's own signal handling still stops its children

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGKILL when the parent dies; exit at once if it already has (when its pid is
    known: a forkserver's children have the server, not the process that asked for them, as parent)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)
