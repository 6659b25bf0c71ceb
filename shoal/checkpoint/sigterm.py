"""Let a worker stopped with SIGTERM finish the checkpoint it is writing in the background."""

from __future__ import annotations

import signal
import sys
from types import FrameType


def finish_writes_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(143) in the main thread instead of killing the process at once.

    `shoal run` (and torchrun) stop the surviving workers of a failed job with SIGTERM, and SIGKILL
    only after a grace period. Killed at once, a worker loses the checkpoint an asynchronous
    `CheckpointManager` is still writing, and the restart resumes from an older one. Exiting through
    Python instead, the interpreter waits for that writer, a non-daemon thread, before it ends.
    Call it from the main thread; it replaces any SIGTERM handler installed before.
    """
    signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)
