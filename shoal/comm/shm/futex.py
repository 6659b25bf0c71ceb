"""Sleeping until a 32-bit word in shared memory changes, and waking whoever sleeps on it: Linux
futexes, which work between processes that map the same memory. A rank waiting for its peers this
way costs no CPU, which matters when the ranks outnumber the cores or share them with backward.

Only x86-64 is supported: its stores become visible in program order, so a word published after
the data it guards is never seen before that data. Elsewhere `supported()` is False and callers keep
to paths that synchronize through the kernel.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0  # shared (not FUTEX_PRIVATE_FLAG): the word may be mapped by several processes
_FUTEX_WAKE = 1
_EVERYONE = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and platform.system() == "Linux"


_libc = ctypes.CDLL(None, use_errno=True) if supported() else None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the word at `address` holds `expected`, for at most `timeout_s`. Returns at once if
    it holds something else; may also return early (a wake-up, a signal): callers re-check the word."""
    seconds = max(0.0, timeout_s)
    span = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    if _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected),
                     ctypes.byref(span), None, 0) == -1:
        error = ctypes.get_errno()
        if error not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):  # the word changed, a signal, time: look again
            raise OSError(error, f"futex wait failed: {os.strerror(error)}")


def wake(address: int) -> None:
    """Wake every process sleeping on the word at `address`."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _EVERYONE, None, None, 0)
